"""FP8 training for mega through torchao's float8 (``--fp8-format e4m3|hybrid --fp8-recipe
tensorwise|rowwise``). See the README."""

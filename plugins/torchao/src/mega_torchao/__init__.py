"""FP8 training for mega through torchao's float8 (``--fp8-format e4m3|hybrid --fp8-recipe
tensorwise|rowwise``) and weight-only quantized inference (``--quantization int8|fp8|int4``,
:mod:`mega_torchao.quantization`). See the README."""

from mega_torchao.import_noise import quiet_torchao_import_noise

# Before anything imports torchao (``mega plugins`` asks the backend whether it imports).
quiet_torchao_import_noise()

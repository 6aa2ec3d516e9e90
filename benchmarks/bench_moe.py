"""The MoE layer: forward+backward speed against Hugging Face's Mixtral sparse block, and the
all-to-all dispatcher's traffic at ep4 against the least any dispatcher must move.

    python benchmarks/bench_moe.py [--repeats 7] [--tokens 2048]
    python benchmarks/bench_moe.py --device cuda --dtype bf16 --tokens 32768 --repeats 20 --no-traffic
    python benchmarks/bench_moe.py --device cuda --dtype bf16 --tokens 32768 --repeats 20 --no-traffic \
        --hf-experts grouped_mm

Part 1 (one process; ``--device`` cpu or cuda, ``--dtype`` fp32, bf16 or fp16): mega's ``MoELayer``
and transformers' ``MixtralSparseMoeBlock`` hold the same weights (8 experts, top-2, hidden 512,
expert hidden 1408) and run forward and backward on the same tokens, alternating call by call;
median of ``--repeats`` after a warm-up (on a GPU each call is timed to its last kernel). mega's
layer runs with ``--moe-grouped-gemm``: two ``torch._grouped_mm`` around the activation where the
device has them (CUDA, bf16), else its fused loop over experts; transformers' experts run as
``--hf-experts`` says (its ``experts_implementation``: eager, grouped_mm or batched_mm). The
outputs and input gradients are checked equal: 1e-5 relative in fp32, 3e-2 in 16 bits (the same
products summed in other orders).

Part 2 (4 gloo ranks, ep4, alltoall): one forward and backward of the layer under
:class:`~mega.core.parallel.collectives.CommCounter`; bytes handed to the all-to-alls per token
(nccl-tests convention: the whole buffer, the slots a rank keeps included), against the minimum:
every (token, expert) slot whose expert lives on another rank crosses once each way in forward
and again in backward (4 hidden vectors), and a lower bound below even that, one crossing per
(token, remote rank) pair when a token's two experts share a rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK = 512, 1408, 8, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def moe_config(**overrides):
    from mega.models.mixtral.family import PRESETS

    return dataclasses.replace(PRESETS["tiny"], hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                               num_experts=EXPERTS, moe_router_topk=TOPK, **overrides)


def build_pair(device: torch.device, dtype: torch.dtype, hf_experts: str = "eager"):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from mega.core.kernels import Kernels
    from mega.models.moe.layer import MoELayer

    hf_config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                                           num_experts_per_tok=TOPK, experts_implementation=hf_experts)
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(hf_config)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.02)
    mega = MoELayer(moe_config(moe_grouped_gemm=True), Kernels())
    with torch.no_grad():
        mega.router.weight.copy_(hf.gate.weight)
        mega.experts.linear_fc1.weight.copy_(hf.experts.gate_up_proj)
        mega.experts.linear_fc2.weight.copy_(hf.experts.down_proj)
    return hf.to(device, dtype), mega.to(device, dtype)


def step(module, tokens: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = tokens.detach().requires_grad_()
    out = module(x if layout == "bsh" else x.transpose(0, 1))
    out = out if layout == "bsh" else out.transpose(0, 1)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def synchronizer(device: torch.device):
    """Waits for the device's queued work (a GPU's kernels run after the call returns)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def part_one(repeats: int, tokens: int, device: torch.device, dtype: torch.dtype, hf_experts: str) -> None:
    from mega.models.moe.experts import has_grouped_mm

    hf, mega = build_pair(device, dtype, hf_experts)
    x = torch.randn(tokens // 512, 512, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    (hf_out, hf_grad), (mega_out, mega_grad) = step(hf, x, "bsh"), step(mega, x, "sbh")
    errors = {}
    for what, a, b in (("output", mega_out, hf_out), ("input gradient", mega_grad, hf_grad)):
        errors[what] = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert errors[what] < TOLERANCE[dtype], f"{what} differs from Hugging Face's by {errors[what]:.2g}"
    sync = synchronizer(device)
    times = {"hf": [], "mega": []}
    for _ in range(repeats):
        for name, module, layout in (("hf", hf, "bsh"), ("mega", mega, "sbh")):
            sync()
            start = time.perf_counter()
            step(module, x, layout)
            sync()
            times[name].append(time.perf_counter() - start)
    hf_s, mega_s = statistics.median(times["hf"]), statistics.median(times["mega"])
    mega_path = "grouped GEMM" if has_grouped_mm(x) else "fused loop"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{where}, {str(dtype).removeprefix('torch.')}: mega's experts {mega_path}, HF's {hf_experts}; "
          f"largest differences: output {errors['output']:.1e}, input gradient {errors['input gradient']:.1e}")
    print(f"\n| tokens | HF s | mega s | HF tok/s | mega tok/s | mega / HF |\n|---|---|---|---|---|---|\n"
          f"| {tokens} | {hf_s:.4f} | {mega_s:.4f} | {tokens / hf_s:,.0f} | {tokens / mega_s:,.0f} | {hf_s / mega_s:.2f}x |")


def traffic(tokens_per_rank: int) -> dict:
    from mega.core.build import build_stage  # noqa: F401  (the plugins register the family)
    from mega.core.kernels import Kernels
    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.core.parallel.collectives import CommCounter
    from mega.models.mixtral.model import shard_experts
    from mega.models.moe.layer import MoELayer

    groups = ParallelGroups(ParallelConfig(ep=4))
    torch.manual_seed(0)
    layer = MoELayer(moe_config(moe_token_dispatcher_type="alltoall"), Kernels())
    torch.nn.init.normal_(layer.router.weight, 0, 0.02)
    shard_experts(layer.experts, groups)
    for param in layer.experts.parameters():
        torch.nn.init.normal_(param, 0, 0.02)
    layer.ep_group = groups.ep
    x = torch.randn(tokens_per_rank, 1, HIDDEN, generator=torch.Generator().manual_seed(groups.global_rank),
                    requires_grad=True)
    with CommCounter() as counts:
        layer(x).sum().backward()
    from mega.models.moe.routing import route

    routing = route(layer.router(x.reshape(-1, HIDDEN)).detach(), layer.config)
    home, per_rank = groups.ep.rank, EXPERTS // groups.ep.size
    destination = routing.experts // per_rank
    remote_slots = int((destination != home).sum())
    remote_pairs = sum(len(set(row.tolist()) - {home}) for row in destination)
    stats = counts.stats[("all_to_all", "ep")]
    return {"bytes": stats.bytes, "calls": stats.calls, "remote_slots": remote_slots, "remote_pairs": remote_pairs}


def part_two(tokens_per_rank: int) -> None:
    from mega.testing import DistributedWorld

    world = DistributedWorld(4, timeout_s=600)
    try:
        ranks = world.run(traffic, tokens_per_rank)
    finally:
        world.close()
    vector = HIDDEN * 4  # fp32 bytes of one hidden vector
    tokens = 4 * tokens_per_rank
    sent = sum(r["bytes"] for r in ranks)
    per_slot = 4 * vector * sum(r["remote_slots"] for r in ranks)  # there and back, forward and backward
    per_pair = 4 * vector * sum(r["remote_pairs"] for r in ranks)
    print(f"\n| ep | tokens | all-to-all calls per rank | bytes/token handed to all-to-all | minimum per remote slot | "
          f"minimum per remote (token, rank) | handed / slot minimum |\n|---|---|---|---|---|---|---|\n"
          f"| 4 | {tokens} | {ranks[0]['calls']} | {sent / tokens:,.0f} | {per_slot / tokens:,.0f} | "
          f"{per_pair / tokens:,.0f} | {sent / per_slot:.3f} |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per forward (a multiple of 512)")
    parser.add_argument("--device", default="cpu", help="part 1's device: cpu (default), cuda, cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="part 1's weights and tokens (default fp32)")
    parser.add_argument("--hf-experts", choices=("eager", "grouped_mm", "batched_mm"), default="eager",
                        help="transformers' experts_implementation (default eager, its default)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    parser.add_argument("--no-traffic", action="store_true", help="skip part 2 (4 gloo ranks on the CPU)")
    args = parser.parse_args(argv)
    if args.tokens < 512 or args.tokens % 512:
        parser.error(f"--tokens must be a positive multiple of 512, got {args.tokens}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is visible")
    torch.set_num_threads(args.threads)
    part_one(args.repeats, args.tokens, device, DTYPES[args.dtype], args.hf_experts)
    if not args.no_traffic:
        part_two(args.tokens // 4)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

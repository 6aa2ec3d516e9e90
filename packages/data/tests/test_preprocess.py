"""``mega preprocess`` end to end: Megatron's naming and layout, formats, bad input, atomicity."""

from __future__ import annotations

import bz2
import gzip
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mega.core.cli.main import main as mega
from mega.core.plugins import load_plugins
from mega.core.tokenizer import TokenizerOptions
from mega.data.indexed_dataset import IndexedDataset
from mega.data.sentences import split_sentences
from mega.data.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def gpt2(gpt2_files):
    vocab, merges = gpt2_files
    return build_tokenizer("GPT2BPETokenizer", TokenizerOptions(vocab, merges), plugins=load_plugins())


@pytest.fixture
def gpt2_flags(gpt2_files):
    vocab, merges = gpt2_files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def megatron_way(rows, tokenizer, prefix, keys=("text",), append_eod=False, splitter=None):
    """What Megatron's tools/preprocess_data.py writes for these rows, built with its builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builders = {key: IndexedDatasetBuilder(f"{prefix}_{key}.bin", dtype=np.uint16) for key in keys}
    for row in rows:
        for key in keys:
            text = row[key]
            sentences = text if isinstance(text, list) else (splitter(text) if splitter else [text])
            ids, lengths = [], []
            for sentence in sentences:
                sentence_ids = tokenizer.tokenize(sentence)
                if sentence_ids:
                    ids += sentence_ids
                    lengths.append(len(sentence_ids))
            if ids and append_eod:
                ids.append(tokenizer.eod)
                lengths[-1] += 1
            builders[key].add_document(np.array(ids, dtype=np.int64), lengths)
    for key in keys:
        builders[key].finalize(f"{prefix}_{key}.idx")
    return {key: f"{prefix}_{key}" for key in keys}


def assert_same_files(a: str, b: str):
    for suffix in (".bin", ".idx"):
        assert open(a + suffix, "rb").read() == open(b + suffix, "rb").read(), suffix


def rows_from(corpus, count=None):
    corpus = corpus if count is None else corpus[:count]
    return [{"text": text, "title": text[:20], "id": i} for i, text in enumerate(corpus)]


@pytest.mark.parametrize("workers", [1, 2])
def test_output_is_byte_identical_to_megatrons_way(tmp_path, jsonl_of, mixed_corpus, gpt2, gpt2_flags, workers):
    rows = rows_from(mixed_corpus)
    source = jsonl_of(tmp_path / "in.jsonl", rows)
    argv = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "out"), "--json-keys", "text", "title",
            "--append-eod", "--workers", str(workers), "--block-size", "20000", *gpt2_flags]
    assert mega(argv) == 0
    expected = megatron_way(rows, gpt2, tmp_path / "expected", keys=("text", "title"), append_eod=True)
    assert_same_files(str(tmp_path / "out_text_document"), expected["text"])
    assert_same_files(str(tmp_path / "out_title_document"), expected["title"])
    dataset = IndexedDataset(tmp_path / "out_text_document")
    assert dataset.num_documents == len(rows)
    assert dataset.document(3).tolist() == gpt2.tokenize(rows[3]["text"]) + [gpt2.eod]


def test_split_sentences_and_keep_newlines(tmp_path, jsonl_of, mixed_corpus, gpt2, gpt2_flags):
    rows = rows_from(mixed_corpus, 80) + [{"text": ["already", "split", ""]}]
    source = jsonl_of(tmp_path / "in.jsonl", rows)
    for keep in (False, True):
        prefix = tmp_path / f"keep{keep}"
        flags = ["--keep-newlines", "--append-eod"] if keep else []
        assert mega(["preprocess", "--input", str(source), "--output-prefix", str(prefix), "--split-sentences",
                     "--workers", "1", *flags, *gpt2_flags]) == 0
        expected = megatron_way(rows, gpt2, tmp_path / f"expected{keep}", append_eod=keep,
                                splitter=lambda t, k=keep: split_sentences(t, k))
        assert_same_files(f"{prefix}_text_sentence", expected["text"])
    with_newlines = IndexedDataset(tmp_path / "keepTrue_text_sentence")
    assert with_newlines.num_documents == len(rows) and len(with_newlines) > len(rows)


@pytest.mark.parametrize("compression", ["gz", "zst", "bz2"])
def test_compressed_jsonl(tmp_path, mixed_corpus, gpt2_flags, compression):
    rows = rows_from(mixed_corpus, 50)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path = tmp_path / f"in.jsonl.{compression}"
    if compression == "gz":
        path.write_bytes(gzip.compress(data))
    elif compression == "bz2":
        path.write_bytes(bz2.compress(data))
    else:
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(data)
    assert mega(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "c"), "--workers", "1", *gpt2_flags]) == 0
    assert mega(["preprocess", "--input", str(plain), "--output-prefix", str(tmp_path / "p"), "--workers", "1", *gpt2_flags]) == 0
    assert_same_files(str(tmp_path / "c_text_document"), str(tmp_path / "p_text_document"))


def test_formats_read_through_datasets(tmp_path, mixed_corpus, gpt2, gpt2_flags):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    texts = [t for t in mixed_corpus[:40] if t.strip() and "\n" not in t and "\r" not in t and "\x0b" not in t and "\x0c" not in t]
    texts = [t for t in texts if "\x1c" not in t and "\x85" not in t and "\u2028" not in t and "\u2029" not in t]
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    pyarrow.parquet.write_table(table, tmp_path / "in.parquet")
    pyarrow.csv.write_csv(table, tmp_path / "in.csv")
    with pa.OSFile(str(tmp_path / "in.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "in.csv.gz", "wb") as stream:
        stream.write((tmp_path / "in.csv").read_bytes())
    (tmp_path / "in.json").write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
    expected = megatron_way([{"text": t} for t in texts], gpt2, tmp_path / "expected")["text"]
    for name in ("in.parquet", "in.csv", "in.csv.gz", "in.arrow", "in.txt", "in.json"):
        prefix = tmp_path / name.replace(".", "_")
        assert mega(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(prefix), "--workers", "1", *gpt2_flags]) == 0, name
        assert_same_files(f"{prefix}_text_document", expected)


def test_several_inputs_in_order(tmp_path, jsonl_of, mixed_corpus, gpt2, gpt2_flags):
    rows = rows_from(mixed_corpus, 30)
    first, second = jsonl_of(tmp_path / "a.jsonl", rows[:10]), jsonl_of(tmp_path / "b.jsonl", rows[10:])
    assert mega(["preprocess", "--input", str(first), str(second), "--output-prefix", str(tmp_path / "o"), "--workers", "2", *gpt2_flags]) == 0
    assert_same_files(str(tmp_path / "o_text_document"), megatron_way(rows, gpt2, tmp_path / "e")["text"])


def outputs(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".idx") or ".partial" in p.name)


def test_malformed_line_fails_with_file_and_line_and_leaves_nothing(tmp_path, gpt2_flags, capsys):
    lines = [json.dumps({"text": "fine"}), json.dumps({"text": "also fine"}), "{not json", json.dumps({"text": 3}), json.dumps({"txt": "x"})]
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert mega(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "1", *gpt2_flags]) == 1
    error = capsys.readouterr().err
    assert f"{source}:3: invalid JSON" in error and "--skip-bad-lines" in error
    assert outputs(tmp_path) == []

    assert mega(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "1",
                 "--skip-bad-lines", *gpt2_flags]) == 0
    captured = capsys.readouterr()
    assert "skipped 3 bad lines" in captured.err
    assert f"{source}:4: field 'text' is int, expected a string" in captured.err
    assert f"{source}:5: no field 'text' (fields: txt)" in captured.err
    assert IndexedDataset(tmp_path / "o_text_document").num_documents == 2


def test_bad_rows_of_every_kind(tmp_path, gpt2_flags, capsys):
    lines = ['["a list"]', '{"text": null}', '{"text": "\\ud800 lone surrogate"}', '{"text": ["ok", 5]}',
             "\x80\x81 not utf-8", '{"text": "the one good line"}', ""]
    source = tmp_path / "bad.jsonl"
    source.write_bytes(b"\n".join(line.encode("latin-1") if "\x80" in line else line.encode() for line in lines))
    assert mega(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "1",
                 "--skip-bad-lines", *gpt2_flags]) == 0
    error = capsys.readouterr().err
    assert "skipped 5 bad lines" in error
    for fragment in ("expected a JSON object, got list", "field 'text' is null", "unpaired surrogate",
                     "holding something other than strings", ":5: invalid JSON"):
        assert fragment in error


def test_input_without_tokens_is_an_error(tmp_path, gpt2_flags, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n')
    for name in ("empty.jsonl", "blank.jsonl"):
        assert mega(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "o"), "--workers", "1", *gpt2_flags]) == 1
        assert "no tokens to write" in capsys.readouterr().err
    assert outputs(tmp_path) == []


def test_tokenizer_errors_are_reported_per_line(tmp_path, capsys):
    source = tmp_path / "ids.jsonl"
    source.write_text('{"text": "1 2 3"}\n{"text": "four"}\n{"text": "5"}\n')
    argv = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    assert mega(argv) == 1
    assert f"{source}:2: field 'text' cannot be tokenized" in capsys.readouterr().err
    assert mega([*argv, "--skip-bad-lines", "--append-eod"]) == 0
    dataset = IndexedDataset(tmp_path / "o_text_document")
    assert [dataset.document(i).tolist() for i in range(2)] == [[1, 2, 3, 10], [5, 10]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "/nonexistent.jsonl"], "/nonexistent.jsonl: no such file"),
        (["--input", "{tmp}/in.xyz"], "cannot tell the format"),
        (["--tokenizer-type", "Nope"], "no tokenizer 'Nope'"),
        (["--vocab-file", "/missing.json"], "--vocab-file /missing.json: no such file"),
    ],
)
def test_bad_arguments_fail_clearly(tmp_path, gpt2_flags, capsys, argv, message):
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "in.xyz").write_text('{"text": "x"}\n')
    base = {"--input": str(tmp_path / "in.jsonl"), "--output-prefix": str(tmp_path / "o")}
    flags = dict(zip(gpt2_flags[::2], gpt2_flags[1::2], strict=True)) | base
    flags.update({k: v.format(tmp=tmp_path) for k, v in zip(argv[::2], argv[1::2], strict=True)})
    assert mega(["preprocess", "--workers", "1", *[x for kv in flags.items() for x in kv]]) == 1
    assert message in capsys.readouterr().err
    assert outputs(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_run_leaves_nothing_behind(tmp_path, mixed_corpus, gpt2_flags, signum):
    """SIGTERM or Ctrl-C in the middle of a run: the process exits non-zero, no .bin/.idx (or scratch)
    remains, and the workers die quietly (they once printed ~70 lines of BrokenPipeError)."""
    source = tmp_path / "big.jsonl"
    with open(source, "w") as stream:
        for i in range(20000):
            stream.write(json.dumps({"text": mixed_corpus[i % len(mixed_corpus)] + f" {i}"}) + "\n")
    command = [sys.executable, "-c", "import sys; from mega.core.cli.main import main; sys.exit(main())",
               "preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "2",
               "--block-size", "20000", "--progress", "always", *gpt2_flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    # Wait until it has written its first block (to a hidden scratch directory), then stop it.
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size for p in tmp_path.glob(".*.partial/data.bin")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)  # until every writer of the pipe, workers too, is gone
    assert process.returncode == 128 + signum, stderr.decode()[-2000:]
    assert outputs(tmp_path) == []
    assert f"interrupted by {signal.Signals(signum).name}; no output was written" in stderr.decode()
    assert "Traceback" not in stderr.decode() and "Error" not in stderr.decode(), stderr.decode()[-2000:]
    assert "docs" in stderr.decode()  # the progress line was drawn (forced on with --progress always)


def test_progress_stays_quiet_when_not_a_terminal(tmp_path, jsonl_of, gpt2_flags, capsys):
    source = jsonl_of(tmp_path / "in.jsonl", [{"text": "hello"}] * 10)
    assert mega(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o"), "--workers", "1", *gpt2_flags]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "10 documents" in captured.out and captured.out.count("\n") == 2


def test_progress_line_shows_rate_and_eta():
    import io

    from mega.data.progress import Progress

    stream = io.StringIO()
    progress = Progress(total_bytes=1000, enabled=True, stream=stream, interval=0)
    progress.update(documents=10, tokens=2_500_000, bytes_done=250)
    line = stream.getvalue()
    assert "10 docs" in line and "2.5M tokens" in line and "tok/s" in line and "25.0%" in line and "ETA" in line


def test_merge_command(tmp_path, jsonl_of, mixed_corpus, gpt2, gpt2_flags, capsys):
    rows = rows_from(mixed_corpus, 40)
    for i, part in enumerate((rows[:15], rows[15:])):
        source = jsonl_of(tmp_path / f"p{i}.jsonl", part)
        assert mega(["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "parts" / f"p{i}"), "--workers", "1", *gpt2_flags, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)  # --json: the summary alone, as JSON
        assert summary["documents"] == len(part) and summary["outputs"] == {"text": str(tmp_path / "parts" / f"p{i}_text_document")}
    assert mega(["merge-datasets", "--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged"), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged["inputs"] == [str(tmp_path / "parts" / f"p{i}_text_document") for i in (0, 1)]
    assert merged["output"] == str(tmp_path / "merged") and merged["documents"] == len(rows)
    assert_same_files(str(tmp_path / "merged"), megatron_way(rows, gpt2, tmp_path / "e")["text"])
    assert mega(["merge-datasets", "--input", str(tmp_path / "nothing-here"), "--output-prefix", str(tmp_path / "m2")]) == 1


def test_sentence_splitter_rules():
    text = 'Dr. Smith met J. R. Tolkien in the U.S. in 1950. He said "Yes." Then left! Did he? 3 apples. e.g. this. 你好。世界！'
    assert split_sentences(text) == [
        "Dr. Smith met J. R. Tolkien in the U.S. in 1950.", 'He said "Yes."', "Then left!", "Did he?",
        "3 apples. e.g. this.", "你好。", "世界！",
    ]
    assert split_sentences("One.\n\nTwo.\n", keep_newlines=True) == ["One.\n\n", "Two.\n"]
    assert split_sentences("  ") == [] and split_sentences("no end") == ["no end"]


def test_command_is_registered_and_registration_is_cheap():
    plugins = load_plugins()
    assert "preprocess" in plugins.commands and "merge-datasets" in plugins.commands
    assert "gpt" in plugins.datasets
    # Registering imports none of the heavy libraries: `mega --help` stays fast.
    probe = (
        "import sys; import mega.data.plugin as p; r = lambda *a, **k: None; "
        "p.register_tokenizers(r); p.register_datasets(r); p.register_commands(r); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'tokenizers', 'datasets', 'torch')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"

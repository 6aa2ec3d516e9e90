"""``mega merge-datasets``: concatenate .bin/.idx datasets, like Megatron's tools/merge_datasets.py."""

from __future__ import annotations

import json
import os
import sys

from mega.core.cli.argparser import CommandParser


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog="mega merge-datasets",
        description="Concatenate indexed datasets (in the order given; a directory adds all of its "
        "datasets in name order) into one.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PREFIX_OR_DIR")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json", action="store_true", help="print the result as JSON: inputs, output, documents, sequences, tokens")
    args = parser.parse_args(argv)

    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.data.indexed_dataset import IndexedDatasetError, find_dataset_prefixes, merge_datasets

    prefixes: list[str] = []
    for item in args.input:
        if os.path.isdir(item):
            found = find_dataset_prefixes(item)
            if not found:
                print(f"mega merge-datasets: error: {item}: no .bin/.idx datasets in the directory", file=sys.stderr)
                return 1
            prefixes += found
        else:
            prefixes.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    try:
        merged = merge_datasets(prefixes, args.output_prefix)
    except (IndexedDatasetError, OSError, ValueError) as error:
        print(f"mega merge-datasets: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"inputs": prefixes, "output": merged.prefix, "documents": merged.num_documents,
                          "sequences": merged.sequence_count, "tokens": merged.num_tokens}))
    else:
        print(f"mega merge-datasets: {len(prefixes)} datasets -> {merged}")
    return 0

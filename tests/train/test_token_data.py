"""Token data: folders of pre-tokenized shards (nanoGPT's layout), the split rules, the sampler over them, every
error, and ``mode tokenize`` -> ``mode train --data FOLDER`` -> ``mode sample`` end to end (with a BPE trained
here: nothing is downloaded)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.checkpoint import load_checkpoint, sha256_file
from mode.train.data import BatchSampler, Corpus, eval_batches, text_codec, token_corpus
from mode.train.sources import load_corpus
from mode.train.tokens import (
    META,
    VAL_FRACTION,
    TokenShard,
    dtype_for_vocab,
    open_token_folder,
    split_of,
)

SEQ = 16


def lit(text: str) -> str:
    return re.escape(text)


def write_bin(folder: Path, name: str, ids, dtype: str = "uint16") -> Path:
    """nanoGPT's layout: the raw array, ``np.array(ids, dtype).tofile(path)``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def write_meta(folder: Path, **meta) -> None:
    (folder / META).write_text(json.dumps(meta))


def nanogpt_folder(folder: Path, n_train: int = 3000, n_val: int = 400, vocab: int = 1000) -> Path:
    rng = np.random.default_rng(0)
    write_bin(folder, "train.bin", rng.integers(0, vocab, n_train))
    write_bin(folder, "val.bin", rng.integers(0, vocab, n_val))
    write_meta(folder, dtype="uint16", vocab_size=vocab)
    return folder


def counting_folder(folder: Path, lengths: list[int], dtype: str = "uint16") -> Path:
    """Shard k holds k * 10000 + 0, 1, 2, ...: a window's ids tell which shard and where it came from."""
    for k, n in enumerate(lengths):
        write_bin(folder, f"train_{k:03d}.bin", k * 10_000 + np.arange(n), dtype)
    write_bin(folder, "val_000.bin", 50_000 + np.arange(200), dtype)
    write_meta(folder, dtype=dtype, vocab_size=60_000)
    return folder


# ---------------------------------------------------------------------------------------- opening a folder


def test_bin_shards_open_as_memory_maps_with_the_vocab_of_meta_json(tmp_path):
    corpus = token_corpus(nanogpt_folder(tmp_path / "d", vocab=1000), SEQ)
    assert corpus.vocab_size == 1000 and corpus.path == str((tmp_path / "d").resolve())
    assert [type(p) for p in corpus.train] == [TokenShard] and len(corpus.val) == 1
    assert isinstance(corpus.train[0].ids_N, np.memmap)  # read lazily, never loaded whole
    assert corpus.train[0].ids_N.dtype == np.dtype("<u2")
    assert len(corpus.train[0]) == 3000 and len(corpus.val[0]) == 400
    assert "vocab 1000" in corpus.source and corpus.tokenizer is None
    assert corpus.record() == {
        "kind": "tokens",
        "source": corpus.source,
        "vocab_size": 1000,
        "path": corpus.path,
        "tokenizer": None,
    }


def test_a_byte_corpus_records_bytes():
    c = Corpus(train=np.zeros(100, np.uint8), val=np.zeros(40, np.uint8), source="x")
    assert c.record() == {"kind": "bytes", "source": "x", "vocab_size": 256, "path": None, "tokenizer": None}


def test_uint32_bin_and_npy_shards(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "train.bin", np.arange(100_000, 100_500), "uint32")
    np.save(d / "val.npy", np.arange(70_000, 70_300, dtype=np.uint32))  # a .npy carries its own dtype
    write_meta(d, dtype="uint32", vocab_size=200_000)
    corpus = token_corpus(d, SEQ)
    assert corpus.train[0][0:3].tolist() == [100_000, 100_001, 100_002]
    assert corpus.val[0][0:2].tolist() == [70_000, 70_001]
    x, y = BatchSampler(corpus.train, 4, SEQ, seed=0).next()
    assert x.dtype == y.dtype == torch.int64 and int(x.min()) >= 100_000  # int64 for the model's embedding


def test_npy_only_folder_without_meta_takes_vocab_from_max_id(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "fineweb_train_000000.npy", np.array([3, 1, 4, 1, 5] * 40, dtype=np.uint16))
    np.save(d / "fineweb_train_000001.npy", np.array([9, 2, 6] * 40, dtype=np.uint16))
    np.save(d / "fineweb_val_000000.npy", np.array([2, 7, 1, 8] * 30, dtype=np.uint16))
    corpus = token_corpus(d, SEQ)
    assert corpus.vocab_size == 10  # max id 9 + 1, over every shard
    assert [p.path.name for p in corpus.train] == ["fineweb_train_000000.npy", "fineweb_train_000001.npy"]
    assert [p.path.name for p in corpus.val] == ["fineweb_val_000000.npy"]
    assert isinstance(corpus.train[0].ids_N, np.memmap)


def test_load_corpus_dispatches_on_what_data_names(tmp_path):
    folder = nanogpt_folder(tmp_path / "d")
    assert load_corpus(str(folder), SEQ).vocab_size == 1000
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 400)
    c = load_corpus(str(text), SEQ)
    assert c.vocab_size == 256 and c.path is None and isinstance(c.train, np.ndarray)


def test_dtype_for_vocab():
    assert dtype_for_vocab(512) == "uint16"
    assert dtype_for_vocab(65_536) == "uint16"  # ids 0 .. 65535
    assert dtype_for_vocab(65_537) == "uint32"


# ----------------------------------------------------------------------------------------- the split rule


@pytest.mark.parametrize(
    "name, split",
    [
        ("train.bin", "train"),
        ("val.bin", "val"),
        ("train_000.bin", "train"),
        ("val_003.bin", "val"),
        ("edufineweb_train_000001.npy", "train"),
        ("edufineweb_val_000000.npy", "val"),
        ("shard-valid.bin", "val"),
        ("validation.npy", "val"),
        ("shard_000.bin", None),
        ("trainer.bin", None),
        ("interval.bin", None),
    ],
)
def test_split_of_reads_the_words_of_the_name(name, split):
    assert split_of(name) == split


def test_val_shards_by_name_in_name_order(tmp_path):
    d = tmp_path / "d"
    for name in ("train_001.bin", "val_000.bin", "train_000.bin", "val_001.bin"):
        write_bin(d, name, np.arange(100))
    (d / "notes.txt").write_text("not a shard")  # other files are not shards
    write_meta(d, dtype="uint16", vocab_size=100)
    corpus = token_corpus(d, SEQ)
    assert [p.path.name for p in corpus.train] == ["train_000.bin", "train_001.bin"]
    assert [p.path.name for p in corpus.val] == ["val_000.bin", "val_001.bin"]


def test_one_shard_holds_out_its_last_tenth(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "train.bin", np.arange(1000))
    write_meta(d, dtype="uint16", vocab_size=1000)
    corpus = token_corpus(d, SEQ)
    cut = int(1000 * (1 - VAL_FRACTION))
    assert cut == 900
    assert len(corpus.train) == len(corpus.val) == 1
    assert corpus.train[0][0 : len(corpus.train[0])].tolist() == list(range(900))
    assert corpus.val[0][0 : len(corpus.val[0])].tolist() == list(range(900, 1000))
    assert "last 10% of train.bin" in corpus.source
    sampler = BatchSampler(corpus.train, 64, SEQ, seed=0)
    for _ in range(20):  # training never reads the held-out tail
        x, y = sampler.next()
        assert int(y.max()) < 900


def test_several_train_shards_and_no_val_hold_out_the_tail_of_the_last(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "train_000.bin", np.arange(500))
    write_bin(d, "train_001.bin", 1000 + np.arange(300))
    write_meta(d, dtype="uint16", vocab_size=2000)
    corpus = token_corpus(d, SEQ)
    assert [len(p) for p in corpus.train] == [500, 270] and [len(p) for p in corpus.val] == [30]
    assert corpus.val[0][0:1].tolist() == [1270]


def test_meta_shard_list_is_authoritative_and_its_counts_checked(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "a.bin", np.arange(300))
    write_bin(d, "b.bin", np.arange(100))
    write_bin(d, "train_stale.bin", np.arange(50))  # not listed: not read
    write_meta(
        d,
        dtype="uint16",
        vocab_size=300,
        shards=[{"file": "a.bin", "split": "train", "tokens": 300}, {"file": "b.bin", "split": "val", "tokens": 100}],
    )
    corpus = token_corpus(d, SEQ)
    assert [p.path.name for p in corpus.train] == ["a.bin"] and [p.path.name for p in corpus.val] == ["b.bin"]


# -------------------------------------------------------------------------------------------- the sampler


def test_one_shard_samples_exactly_what_the_byte_sampler_samples(tmp_path):
    """The same seeded sampler: one shard gives the windows its ids give as one in-memory array."""
    corpus = token_corpus(nanogpt_folder(tmp_path / "d"), SEQ)
    array = np.fromfile(tmp_path / "d" / "train.bin", dtype="<u2")
    a, b = BatchSampler(corpus.train, 8, SEQ, seed=5), BatchSampler(array, 8, SEQ, seed=5)
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_shard_sampler_is_deterministic_and_resumes(tmp_path):
    corpus = token_corpus(counting_folder(tmp_path / "d", [400, 300, 500]), SEQ)
    a, b = BatchSampler(corpus.train, 6, SEQ, seed=1), BatchSampler(corpus.train, 6, SEQ, seed=1)
    torch.manual_seed(99)  # the global RNG plays no part
    batches = [a.next() for _ in range(4)]
    for x, y in batches:
        xb, yb = b.next()
        assert torch.equal(x, xb) and torch.equal(y, yb)
    other = BatchSampler(corpus.train, 6, SEQ, seed=2).next()
    assert not torch.equal(other[0], batches[0][0])
    state = a.generator.get_state()  # what the trainer checkpoints
    expected = [a.next() for _ in range(3)]
    resumed = BatchSampler(corpus.train, 6, SEQ, seed=12345)
    resumed.generator.set_state(state)
    for x, y in expected:
        xr, yr = resumed.next()
        assert torch.equal(x, xr) and torch.equal(y, yr)


def test_windows_never_cross_a_shard_end_and_cover_every_shard(tmp_path):
    lengths = [400, 10, 300, SEQ + 2]  # a shard of 10 ids holds no window; one of S + 2 holds exactly one
    corpus = token_corpus(counting_folder(tmp_path / "d", lengths), SEQ)
    sampler = BatchSampler(corpus.train, 64, SEQ, seed=0)
    seen = set()
    for _ in range(40):
        x, y = sampler.next()
        w = torch.cat([x, y[:, -1:]], 1)  # the whole window of S + 1 ids
        shard = w // 10_000
        assert (shard == shard[:, :1]).all(), "a window crossed a shard boundary"
        assert (w.diff(dim=1) == 1).all(), "a window is not contiguous"
        assert ((w[:, -1] % 10_000) < torch.tensor(lengths, device=w.device)[shard[:, 0]]).all()  # w: on the CPU
        seen |= set(shard[:, 0].tolist())
    assert seen == {0, 2, 3}  # every shard with a window is sampled, the 10-id one never


def test_eval_batches_over_shards_are_fixed_and_inside_shards(tmp_path):
    d = counting_folder(tmp_path / "d", [100])
    write_bin(d, "val_001.bin", 60_000 - 300 + np.arange(300))
    write_meta(d, dtype="uint16", vocab_size=60_000)
    corpus = token_corpus(d, SEQ)
    batches = eval_batches(corpus.val, 4, SEQ, 3)
    again = eval_batches(corpus.val, 4, SEQ, 3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again):
        assert torch.equal(x, x2) and torch.equal(y, y2) and x.dtype == torch.int64
        w = torch.cat([x, y[:, -1:]], 1)
        assert (w.diff(dim=1) == 1).all()  # contiguous: inside one shard
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert int(starts[0]) == 50_000  # the first window opens the first shard ...
    assert int(batches[-1][1][-1, -1]) == 59_998  # ... the last one ends where the byte corpus's does (N - 2)


# ------------------------------------------------------------------------------------------------- errors


def test_truncated_bin_not_a_multiple_of_the_dtype(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    with open(d / "train.bin", "ab") as f:
        f.write(b"\x01")  # 6001 bytes of uint16
    with pytest.raises(
        ValueError,
        match=lit(f"{d / 'train.bin'}: truncated: 6001 bytes is not a multiple of 2 (uint16, meta.json's dtype)"),
    ):
        token_corpus(d, SEQ)


def test_bin_shorter_than_meta_json_says(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "train.bin", np.arange(100))
    write_meta(d, dtype="uint16", vocab_size=100, shards=[{"file": "train.bin", "tokens": 120}])
    with pytest.raises(
        ValueError, match=lit(f"{d / 'train.bin'}: truncated: holds 100 tokens, meta.json says tokens=120")
    ):
        token_corpus(d, SEQ)


def test_truncated_npy(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "train.npy", np.arange(1000, dtype=np.uint16))
    data = (d / "train.npy").read_bytes()
    (d / "train.npy").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=lit(f"{d / 'train.npy'}: truncated: its header says 1000 ids of 2 bytes")):
        token_corpus(d, SEQ)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.int32])
def test_npy_of_the_wrong_dtype(tmp_path, dtype):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "train.npy", np.arange(100).astype(dtype))
    with pytest.raises(
        ValueError,
        match=lit(f"{d / 'train.npy'}: dtype {np.dtype(dtype)}: a shard holds token ids as uint16 or uint32"),
    ):
        token_corpus(d, SEQ)


def test_npy_of_objects_is_refused_without_unpickling(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "train.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=lit("dtype object: a shard holds token ids as uint16 or uint32")):
        token_corpus(d, SEQ)


def test_npy_of_two_dimensions(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "train.npy", np.zeros((4, 50), dtype=np.uint16))
    with pytest.raises(ValueError, match=lit("shape (4, 50): a shard is a 1-D array of token ids")):
        token_corpus(d, SEQ)


@pytest.mark.parametrize("dtype", ["int64", "float32", "uint8"])
def test_meta_dtype_must_be_uint16_or_uint32(tmp_path, dtype):
    d = nanogpt_folder(tmp_path / "d")
    write_meta(d, dtype=dtype, vocab_size=1000)
    with pytest.raises(ValueError, match=lit(f"{d / META}: dtype={dtype!r}: must be one of uint16, uint32")):
        token_corpus(d, SEQ)


def test_bin_without_meta_json_has_no_dtype(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    (d / META).unlink()
    with pytest.raises(
        ValueError, match=lit(f"{d / 'train.bin'}: a .bin shard has no dtype of its own: write {d / META}")
    ):
        token_corpus(d, SEQ)


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"dtype": "uint16"}, "vocab_size=None: must be an int >= 1"),
        ({"dtype": "uint16", "vocab_size": 0}, "vocab_size=0: must be an int >= 1"),
        ({"dtype": "uint16", "vocab_size": 70_000}, "vocab_size=70000 does not fit dtype uint16 (at most 65536 ids)"),
        ({"dtype": "uint16", "vocab_size": 10, "vocab": 10}, "unknown key 'vocab'"),
        ({"dtype": "uint16", "vocab_size": 10, "format": "other"}, "format='other': must be 'mode-tokens'"),
        ({"dtype": "uint16", "vocab_size": 10, "version": 2}, "version=2: this mode reads version 1"),
        ({"dtype": "uint16", "vocab_size": 10, "shards": [{"file": "../x.bin"}]}, "must be a file name inside"),
        ({"dtype": "uint16", "vocab_size": 10, "shards": [{"file": "nope.bin"}]}, "'nope.bin': must be 'train' or"),
        ({"dtype": "uint16", "vocab_size": 10, "tokenizer": {"path": "missing.json"}}, "'missing.json': no such file"),
    ],
)
def test_bad_meta_json(tmp_path, meta, message):
    d = nanogpt_folder(tmp_path / "d")
    write_meta(d, **meta)
    with pytest.raises(ValueError, match=lit(message)):
        token_corpus(d, SEQ)


def test_meta_json_not_json(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    (d / META).write_text("{dtype: uint16")
    with pytest.raises(ValueError, match=lit(f"{d / META}: not readable JSON")):
        token_corpus(d, SEQ)


def test_empty_shard(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    (d / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=lit(f"{d / 'val.bin'}: an empty shard (0 tokens)")):
        token_corpus(d, SEQ)


def test_empty_folder(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=lit(f"data={str(tmp_path / 'd')!r}: no .bin or .npy shards in the folder")):
        token_corpus(tmp_path / "d", SEQ)


def test_folder_with_no_train_shard(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "val.bin", np.arange(100))
    write_meta(d, dtype="uint16", vocab_size=100)
    with pytest.raises(ValueError, match=lit(f"data={str(d)!r}: no training shard: val.bin are all validation")):
        token_corpus(d, SEQ)


def test_shard_named_neither_train_nor_val(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    write_bin(d, "shard_000.bin", np.arange(100))
    with pytest.raises(ValueError, match=lit("'shard_000.bin': a shard's name must hold the word 'train' or 'val'")):
        token_corpus(d, SEQ)


def test_listed_shard_missing(tmp_path):
    d = nanogpt_folder(tmp_path / "d")
    write_meta(d, dtype="uint16", vocab_size=1000, shards=[{"file": "train.bin"}, {"file": "train_001.bin"}])
    with pytest.raises(ValueError, match=lit("'train_001.bin' is listed in meta.json but is not in the folder")):
        token_corpus(d, SEQ)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match=lit(f"data={str(tmp_path / 'x')!r}: not a folder of token shards")):
        open_token_folder(tmp_path / "x")


def test_shards_too_short_for_a_window(tmp_path):
    d = tmp_path / "d"
    write_bin(d, "train_000.bin", np.arange(SEQ + 1))
    write_bin(d, "train_001.bin", np.arange(5))
    write_bin(d, "val.bin", np.arange(100))
    write_meta(d, dtype="uint16", vocab_size=100)
    with pytest.raises(
        ValueError,
        match=lit(
            f"no training shard holds more than seq_len + 1 = {SEQ + 1} tokens "
            f"(the longest holds {SEQ + 1}; windows never cross a shard's end)"
        ),
    ):
        token_corpus(d, SEQ)
    corpus = token_corpus(d)  # without seq_len: the sampler says it
    with pytest.raises(ValueError, match=lit(f"data has {SEQ + 6} tokens in 2 shards, none longer than {SEQ + 1}")):
        BatchSampler(corpus.train, 2, SEQ, seed=0)


def test_token_id_at_or_above_vocab_fails_when_its_window_is_read(tmp_path):
    """Ids are checked as windows are read (a shard is never scanned whole when meta.json gives the vocab)."""
    d = tmp_path / "d"
    ids = np.full(SEQ + 2, 7)
    ids[SEQ // 2] = 512  # every window of this shard holds it
    write_bin(d, "train.bin", ids)
    write_bin(d, "val.bin", np.arange(100))
    write_meta(d, dtype="uint16", vocab_size=512)
    corpus = token_corpus(d, SEQ)  # opening reads no ids
    with pytest.raises(
        ValueError,
        match=lit(
            f"{d / 'train.bin'}: token id 512 at position {SEQ // 2} is >= "
            "vocab_size=512; every id must be < vocab_size"
        ),
    ):
        BatchSampler(corpus.train, 2, SEQ, seed=0).next()


def test_token_id_above_vocab_in_validation(tmp_path):
    d = nanogpt_folder(tmp_path / "d", vocab=1000)
    ids = np.fromfile(d / "val.bin", dtype="<u2")
    ids[250] = 1000
    ids.tofile(d / "val.bin")
    corpus = token_corpus(d, SEQ)
    with pytest.raises(ValueError, match=lit(f"{d / 'val.bin'}: token id 1000 at position 250 is >= vocab_size=1000")):
        eval_batches(corpus.val, 8, SEQ, 8)  # these windows cover the split end to end


def test_a_model_vocab_below_the_data_vocab_is_refused(tmp_path):
    corpus = token_corpus(nanogpt_folder(tmp_path / "d", vocab=1000), SEQ)
    cfg = LMConfig(vocab_size=256, seq_len=SEQ, d_model=16, n_heads=2, d_hidden=32, layers=("dense",))
    with pytest.raises(ValueError, match=lit("model_cfg.vocab_size=256: the data's ids go up to 999")):
        Trainer(cfg, TrainConfig(steps=1, batch_size=2, eval_batches=1), corpus, tmp_path / "run", progress=False)


def test_training_on_shards_resumes_to_the_same_batches_and_losses(tmp_path):
    corpus = token_corpus(counting_folder(tmp_path / "d", [400, 300, 500]), SEQ)
    cfg = LMConfig(
        vocab_size=corpus.vocab_size, seq_len=SEQ, d_model=16, n_heads=2, d_hidden=32, layers=("dense", "mod")
    )
    tcfg = TrainConfig(steps=4, batch_size=4, warmup_steps=1, eval_every=2, eval_batches=1, log_every=1)
    straight = Trainer(cfg, tcfg, corpus, tmp_path / "a", progress=False).run()
    first = Trainer(cfg, tcfg, corpus, tmp_path / "b", progress=False)
    first.run(stop_step=2)
    again = Trainer(cfg, tcfg, corpus, tmp_path / "b", progress=False)
    again.load()
    assert again.data == first.data == corpus.record()
    resumed = again.run()
    assert [r.get("loss") for r in resumed] == [r.get("loss") for r in straight]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in straight]


def test_a_byte_checkpoint_decodes_bytes_and_refuses_a_tokenizer(tmp_path):
    codec = text_codec(None, "checkpoint 'x'")  # checkpoints from before token data: bytes
    assert codec.name == "bytes" and codec.decode(codec.encode("déf")) == "déf"
    with pytest.raises(ValueError, match=lit("the checkpoint was trained on bytes, which need no tokenizer")):
        text_codec({"kind": "bytes"}, "checkpoint 'x'", tokenizer=tmp_path / "t.json")
    with pytest.raises(ValueError, match=lit("with no tokenizer recorded; pass --tokenizer PATH")):
        text_codec({"kind": "tokens", "source": "s", "tokenizer": None}, "checkpoint 'x'")


# --------------------------------------------------------------------- mode tokenize / train / sample (BPE)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A byte-level BPE of 512 ids trained here on a slice of the built-in corpus, saved as tokenizer.json."""
    tokenizers = pytest.importorskip(
        "tokenizers", reason="token data needs the tokenizers package (pip install 'mode-torch[tokens]')"
    )
    from mode.train.data import stdlib_corpus

    text = bytes(stdlib_corpus(max_bytes=1_000_000).train[:200_000]).decode("utf-8", "replace")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    assert tok.get_vocab_size() == 512
    return path


@pytest.fixture(scope="module")
def shards(bpe, tmp_path_factory) -> Path:
    from mode.cli import main

    out = tmp_path_factory.mktemp("tok") / "shards"
    assert (
        main(
            [
                "tokenize",
                "--tokenizer",
                str(bpe),
                "--out",
                str(out),
                "--max-bytes",
                "1000000",
                "--shard-tokens",
                "100000",
            ]
        )
        == 0
    )
    return out


def test_tokenize_builtin_corpus_writes_shards_and_meta(shards, bpe):
    from tokenizers import Tokenizer

    from mode.train.data import VAL_EVERY_NTH_FILE, stdlib_sources

    meta = json.loads((shards / META).read_text())
    assert meta["format"] == "mode-tokens" and meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    assert meta["tokenizer"] == {"path": "tokenizer.json", "sha256": sha256_file(bpe)}  # a copy in the folder
    assert (shards / "tokenizer.json").read_bytes() == bpe.read_bytes()
    train = [s for s in meta["shards"] if s["split"] == "train"]
    val = [s for s in meta["shards"] if s["split"] == "val"]
    assert len(train) >= 2 and all(s["tokens"] == 100_000 for s in train[:-1]) and val
    for s in meta["shards"]:
        assert (shards / s["file"]).stat().st_size == 2 * s["tokens"]
    assert not list(shards.glob(".*.tmp"))  # atomic writes leave nothing behind
    # the split is the built-in corpus's: the 20th file is validation, encoded on its own
    tok = Tokenizer.from_file(str(bpe))
    twentieth = stdlib_sources()[VAL_EVERY_NTH_FILE - 1].read_bytes().decode("utf-8", "replace")
    expected = tok.encode(twentieth, add_special_tokens=False).ids
    got = np.fromfile(shards / val[0]["file"], dtype="<u2")[: len(expected)]
    assert got.tolist() == expected
    corpus = token_corpus(shards, 64)
    assert corpus.vocab_size == 512 and corpus.tokenizer.sha256 == sha256_file(bpe)
    assert sum(len(p) for p in corpus.train) == sum(s["tokens"] for s in train)


def test_tokenize_one_file_round_trips_and_splits_by_tokens(bpe, tmp_path):
    from tokenizers import Tokenizer

    from mode.train.tokenize import tokenize

    text = "def add(a, b):\n    return a + b\n\n" * 200 + "class Café:\n    pass\n" * 50
    src = tmp_path / "code.txt"
    src.write_text(text, encoding="utf-8")
    meta = tokenize(bpe, tmp_path / "out", src, shard_tokens=1000, eot="<|endoftext|>")
    tok = Tokenizer.from_file(str(bpe))
    ids = np.concatenate(
        [np.fromfile(tmp_path / "out" / s.file, dtype="<u2") for s in meta.shards if s.split == "train"]
        + [np.fromfile(tmp_path / "out" / s.file, dtype="<u2") for s in meta.shards if s.split == "val"]
    )
    eot = tok.token_to_id("<|endoftext|>")
    assert ids[-1] == eot and tok.decode(ids[:-1].tolist()) == text  # lossless, eot after the document
    n_val = sum(s.tokens for s in meta.shards if s.split == "val")
    assert n_val == len(ids) - int(len(ids) * (1 - VAL_FRACTION))


def test_tokenize_a_folder_of_few_files_splits_by_tokens(bpe, tmp_path):
    from mode.train.tokenize import tokenize

    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha beta\n" * 300)
    (src / "sub" / "b.txt").write_text("gamma delta\n" * 300)
    (src / ".hidden").write_bytes(b"\xff not text, skipped")
    meta = tokenize(bpe, tmp_path / "out", src)
    assert meta.source == f"{src} (2 files)"
    n = {split: sum(s.tokens for s in meta.shards if s.split == split) for split in ("train", "val")}
    total = n["train"] + n["val"]
    assert n["train"] == int(total * (1 - VAL_FRACTION))  # fewer than 20 files: the last 10% of the tokens


def test_tokenize_picks_uint32_above_65536_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="token data needs the tokenizers package")
    from mode.train.tokenize import tokenize

    vocab = {f"w{i}": i for i in range(70_000)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("w69999 w5 w65536 " * 100)
    meta = tokenize(tmp_path / "tokenizer.json", tmp_path / "out", tmp_path / "t.txt")
    assert meta.dtype == "uint32" and meta.vocab_size == 70_000
    train = np.fromfile(tmp_path / "out" / "train_000.bin", dtype="<u4")
    assert train[:3].tolist() == [69_999, 5, 65_536]
    corpus = token_corpus(tmp_path / "out", 8)
    assert corpus.vocab_size == 70_000 and BatchSampler(corpus.train, 2, 8, seed=0).next()[0].max() >= 5


def test_tokenize_errors(bpe, tmp_path, shards):
    from mode.train.tokenize import tokenize

    src = tmp_path / "a.txt"
    src.write_text("hello " * 100)
    with pytest.raises(ValueError, match=lit(f"out={str(shards)!r}: already holds 'meta.json'")):
        tokenize(bpe, shards, src)
    with pytest.raises(ValueError, match=lit("eot='<eos>': not a token of")):
        tokenize(bpe, tmp_path / "o1", src, eot="<eos>")
    with pytest.raises(ValueError, match=lit(f"tokenizer={str(tmp_path / 'no.json')!r}: no such file")):
        tokenize(tmp_path / "no.json", tmp_path / "o2", src)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=lit("not a readable Hugging Face tokenizer.json")):
        tokenize(tmp_path / "bad.json", tmp_path / "o3", src)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe abc")
    with pytest.raises(ValueError, match=lit("not valid UTF-8")):
        tokenize(bpe, tmp_path / "o4", tmp_path / "bin.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=lit("no training tokens (the text is empty)")):
        tokenize(bpe, tmp_path / "o5", tmp_path / "empty.txt")


def test_train_sample_and_report_on_token_shards(shards, bpe, tmp_path, capsys):
    """``mode train --data FOLDER``: the model takes the data's vocab (FLOPs follow it), the checkpoint records
    the tokenizer, ``mode sample`` decodes with it; without the tokenizer file, a clear error."""
    from mode.cli import main
    from mode.measure.flops import forward_flops

    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--preset",
                "quick",
                "--data",
                str(shards),
                "--steps",
                "3",
                "--eval-every",
                "3",
                "--threads",
                "1",
                "--out",
                str(run),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "vocab 512" in out
    state = load_checkpoint(run / "ckpt.pt")
    assert state["model_cfg"]["vocab_size"] == 512
    assert state["data"]["kind"] == "tokens" and state["data"]["vocab_size"] == 512
    assert state["data"]["tokenizer"] == {
        "path": str((shards / "tokenizer.json").resolve()),
        "sha256": sha256_file(bpe),
    }
    assert state["model"]["embed.weight"].shape[0] == 512
    cfg = LMConfig(**state["model_cfg"])
    assert forward_flops(cfg)[-1].total == 2 * cfg.seq_len * cfg.d_model * 512  # the head follows the vocab
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in log) and log[-1]["step"] == 3

    assert main(["sample", str(run / "ckpt.pt"), "--prompt", "def ", "--max-new-tokens", "8", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("--- prompt: 'def '\ndef ")
    from tokenizers import Tokenizer

    from mode.model.generate import generate
    from mode.train import load_model

    model, _ = load_model(run / "ckpt.pt")
    tok = Tokenizer.from_file(str(bpe))
    new = generate(model, [tok.encode("def ").ids], 8, temperature=0.8, seed=0)[0]
    assert printed.splitlines()[1:] == ("def " + tok.decode(new)).splitlines()  # decoded by the tokenizer

    report_dir = tmp_path / "report"
    assert main(["report", str(run / "ckpt.pt"), "--batches", "1", "--out", str(report_dir), "--threads", "1"]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["model"]["vocab_size"] == 512 and "top_tokens" in report and "top_bytes" not in report
    assert report["data"]["source"].startswith("token shards")  # the checkpoint's own shards, by default
    capsys.readouterr()

    moved = tmp_path / "elsewhere.json"
    shutil.copy(shards / "tokenizer.json", moved)
    (shards / "tokenizer.json").rename(tmp_path / "hidden.json")
    try:
        assert main(["sample", str(run / "ckpt.pt"), "--max-new-tokens", "2", "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert "which is missing; pass --tokenizer PATH to a copy of it" in err
        assert (
            main(["sample", str(run / "ckpt.pt"), "--max-new-tokens", "2", "--threads", "1", "--tokenizer", str(moved)])
            == 0
        )
        capsys.readouterr()
        moved.write_text(moved.read_text().replace('"<|endoftext|>"', '"<|eot|>"'))
        assert main(["sample", str(run / "ckpt.pt"), "--max-new-tokens", "2", "--tokenizer", str(moved)]) == 2
        assert "not the same tokenizer" in capsys.readouterr().err
    finally:
        (tmp_path / "hidden.json").rename(shards / "tokenizer.json")

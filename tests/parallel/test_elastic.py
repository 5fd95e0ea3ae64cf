"""``mode.parallel.elastic.attempt_store``: under torchrun's shared agent store, each restart's process groups
meet under keys of their own, so nothing a dead attempt wrote (a gloo address) is read by the next. The
end-to-end case, a rank killed under ``torchrun --max-restarts 1``, is tests/parallel/test_faults.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from mode.parallel.elastic import attempt, attempt_store


def test_each_attempt_has_its_own_keys(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    first = attempt_store(10)
    first.set("default_pg/0", "address of the first attempt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt() == 1
    second = attempt_store(10)
    assert not second.check(["default_pg/0"])  # the restarted group does not see it
    second.set("default_pg/0", "address of the second attempt")
    assert first.get("default_pg/0") == b"address of the first attempt"
    assert agent.check(["mode/job/attempt-0/default_pg/0", "mode/job/attempt-1/default_pg/0"])


def test_nothing_to_isolate_without_a_shared_agent_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(10) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    assert attempt_store(10) is None
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert attempt() == 0


def test_a_restart_without_resume_auto_says_what_to_add(tmp_path, monkeypatch):
    from mode.parallel.command import build_parser, checkpoint_to_resume

    (tmp_path / "ckpt.pt").write_bytes(b"x")
    args = build_parser().parse_args(["--out", str(tmp_path)])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(
        ValueError,
        match=r"already holds a run's checkpoint .* \(torchrun restarted this group, "
        r"attempt 1: start it with --resume auto",
    ):
        checkpoint_to_resume(args, None)

"""Atomic checkpoints: complete or absent, pruned, loaded with weights_only."""

import pytest
import torch

from hybridrec.train import checkpoint as ckpt


def test_save_load_prune(tmp_path):
    for step in (10, 20, 30):
        ckpt.save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step)), "step": step}, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 30]
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    assert state["step"] == 30 and state["w"].tolist() == [30.0, 30.0]


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 1, {"a": torch.zeros(1)})

    def broken(obj, path):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(tmp_path, 2, {"a": torch.zeros(1)})
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["step-00000001"]


def test_incomplete_directory_is_ignored(tmp_path):
    (ckpt.checkpoint_dir(tmp_path) / "step-00000005").mkdir(parents=True)
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_load_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    d = ckpt.checkpoint_dir(tmp_path) / "step-00000001"
    d.mkdir(parents=True)
    torch.save({"x": Evil()}, d / "state.pt")
    (d / "meta.json").write_text("{}")
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt.load_checkpoint(d)

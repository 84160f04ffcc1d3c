"""What the commands leave on disk: files made with the user's umask, and nothing at all when the disk
fills up (generate writes every file or none; export's OUT_DIR appears complete or not at all)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hf_scale.commands.cli import main
from hf_scale.train.checkpoint import store

ASSETS = Path(__file__).resolve().parents[2] / "hf_scale" / "assets" / "tiny-llama"


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("mask", "plain", "script"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o002, 0o664, 0o775), (0o133, 0o644, 0o644)])
def test_generated_files_follow_the_umask(mask, plain, script, tmp_path, capsys):
    with umask(mask):
        assert main(["generate", "--preset", "zero3", "--output-dir", str(tmp_path)]) == 0
        assert main(["plan", str(ASSETS), "--write-config", str(tmp_path / "plan.yaml")]) == 0
    found = modes(tmp_path)
    assert len(found) == 8  # the 7 files of generate (hf_scale_configs/ among them) and the plan
    for rel, mode in found.items():
        assert mode == (script if rel.endswith((".sh", ".sbatch")) else plain), (rel, oct(mode))
    assert stat.S_IMODE((tmp_path / "launch").stat().st_mode) == 0o777 & ~mask


def _fill_up(path: Path, leave: int) -> None:
    """Leave about `leave` bytes free on the file system holding `path`."""
    free = shutil.disk_usage(path).free
    with open(path / "ballast", "wb") as handle:
        handle.write(b"\0" * max(0, free - leave))


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB file system (tmpfs; needs root, as in CI), nearly full."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the RLIMIT_FSIZE test covers it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_generate_on_a_full_disk_writes_nothing(small_disk, capsys):
    _fill_up(small_disk, 12 * 1024)  # room for some of the 6 files, not all
    before = sorted(p.name for p in small_disk.iterdir())
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--preset", "zero3", "--output-dir", str(small_disk / "out")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device; nothing was written" in err
    assert sorted(p.name for p in small_disk.iterdir()) == before  # not even the directories


def test_generate_force_on_a_full_disk_keeps_the_old_files(small_disk, capsys):
    out = small_disk / "out"
    assert main(["generate", "--preset", "zero3", "--output-dir", str(out)]) == 0
    old = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _fill_up(small_disk, 4 * 1024)
    with pytest.raises(SystemExit):
        main(["generate", "--preset", "zero3", "--set", "deepspeed.zero_stage=2", "--force", "--output-dir", str(out)])
    assert "nothing was written" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == old
    assert not [p for p in out.rglob(".hf-scale-staging-*")]


def test_generate_past_a_file_size_limit_writes_nothing(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the bigger files (EFBIG) while the small ones fit."""
    out = tmp_path / "out"
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (2500, 2500))\n"
        "from hf_scale.commands.cli import main\n"
        f"sys.exit(main(['generate', '--preset', 'zero3', '--output-dir', {str(out)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "File too large; nothing was written" in result.stderr
    assert not out.exists()


def _tiny_checkpoint(path: Path) -> Path:
    shutil.copytree(ASSETS, path)
    store.write_manifest(path, 1)
    return path


def test_export_on_a_full_disk_leaves_nothing_and_says_so(small_disk, tmp_path, capsys):
    source = _tiny_checkpoint(tmp_path / "checkpoint-1")
    _fill_up(small_disk, 64 * 1024)  # the weights alone are ~400 KiB
    with pytest.raises(SystemExit) as exited:
        main(["export", str(source), str(small_disk / "model")])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("hf-scale: error: OUT_DIR") and "No space left on device" in last
    assert sorted(p.name for p in small_disk.iterdir()) == ["ballast"]


def test_export_follows_the_umask(tmp_path, capsys):
    source = _tiny_checkpoint(tmp_path / "checkpoint-1")
    with umask(0o027):
        main(["export", str(source), str(tmp_path / "model")])
    found = modes(tmp_path / "model")
    assert found and set(found.values()) == {0o640}

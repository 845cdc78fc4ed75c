"""``bench/voice_state.sh`` (issue 35): the voice's training state is kept in git history, named
by ``voice-state.ref``, out of the tree every device call carries; ``store`` commits returned
parts and takes them out again, ``restore`` brings them back byte for byte, and a commit the
clone lacks is a clear error (run in a throwaway git repository)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "voice_state.sh"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout


def _script(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env,
                          capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "README").write_text("x\n")
    _git(repo, "add", "README")
    _git(repo, "commit", "-q", "-m", "start")
    return repo


def _parts(folder: Path, seed: int) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    parts = {"state.000": os.urandom(4096) + bytes([seed]), "state.json": b'{"parts": 1}'}
    for name, data in parts.items():
        (folder / name).write_bytes(data)
    return parts


def test_store_keeps_the_parts_in_history_and_restore_brings_them_back(repo: Path,
                                                                       tmp_path: Path) -> None:
    first = _parts(tmp_path / "out1", 1)
    done = _script(repo, "store", str(tmp_path / "out1"), "voice: call one")
    assert done.returncode == 0, done.stderr
    assert not (repo / "voice-state").exists()  # the tree does not carry them
    assert _git(repo, "status", "--porcelain") == ""
    ref = (repo / "voice-state.ref").read_text()
    commit = next(line.split()[1] for line in ref.splitlines() if line.startswith("commit "))
    assert _git(repo, "log", "-1", "--format=%s", commit).strip() == "voice: call one"
    done = _script(repo, "restore", str(tmp_path / "back"))
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "back").iterdir()} == first
    # a second call's parts replace them; restore leaves no stale part behind
    (tmp_path / "back" / "state.001").write_bytes(b"stale")
    second = _parts(tmp_path / "out2", 2)
    assert _script(repo, "store", str(tmp_path / "out2"), "voice: call two").returncode == 0
    assert _script(repo, "restore", str(tmp_path / "back")).returncode == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "back").iterdir()} == second


def test_restore_says_what_is_missing(repo: Path, tmp_path: Path) -> None:
    (repo / "voice-state.ref").write_text("commit " + "0" * 40 + "\n")
    done = _script(repo, "restore", str(tmp_path / "back"))
    assert done.returncode == 3 and "not in this clone" in done.stderr
    (repo / "voice-state.ref").write_text("nothing here\n")
    done = _script(repo, "restore", str(tmp_path / "back"))
    assert done.returncode == 2 and "names no commit" in done.stderr


def test_store_refuses_without_parts_or_with_a_dirty_index(repo: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = _script(repo, "store", str(tmp_path / "empty"), "m")
    assert done.returncode == 2 and "no state.*" in done.stderr
    _parts(tmp_path / "out", 3)
    (repo / "other").write_text("y\n")
    _git(repo, "add", "other")
    done = _script(repo, "store", str(tmp_path / "out"), "m")
    assert done.returncode == 2 and "index is not clean" in done.stderr

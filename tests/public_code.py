"""Public reference code (the TimeSformer, detectron2 and nanoGPT repositories) read as test data at test time.

Nothing from these repositories is copied into attnlab or its tests: a test names a file of a repository, and this
helper reads it from ``$ATTNLAB_PUBLIC_CODE`` (folders separated by ``os.pathsep``), where each repository is a
folder named ``<owner>+<name>`` (or ``<name>``) holding a checkout, a ``repo/`` checkout or a bare git directory, e.g.

    git clone https://github.com/facebookresearch/TimeSformer $ATTNLAB_PUBLIC_CODE/facebookresearch+TimeSformer

Without it the helper looks in ``../shared/public_code`` beside the checkout (where CI, which has no network to
GitHub, finds what the project's shared folder holds); where neither has the repository the test skips, naming the
repository and the variable; the independent
float64 references (``tests/reference_*.py``) run everywhere. A module is executed from the file's text with the
imports that would pull in the rest of its repository (registries, checkpoint helpers, code for other torch
versions) given as small stubs that the test states; what the test compares is the file's own code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ENV = "ATTNLAB_PUBLIC_CODE"


#: where CI finds the repositories when the variable is unset: the project's shared folder beside the checkout
SHARED = Path(__file__).resolve().parents[2] / "shared" / "public_code"


def _roots() -> list[Path]:
    return [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p] or [SHARED]


def _repo_dirs(repo: str) -> list[Path]:
    owner, name = repo.split("/")
    out = []
    for root in _roots():
        for folder in (root / f"{owner}+{name}", root / name):
            out += [folder / "repo", folder]
    return [d for d in out if d.is_dir()]


def read_source(repo: str, path: str) -> str:
    """The text of ``path`` in the GitHub repository ``repo`` (``owner/name``); skips the test when it is absent."""
    for folder in _repo_dirs(repo):
        if (folder / path).is_file():
            return (folder / path).read_text()
        git_dir = folder / ".git" if (folder / ".git").exists() else folder
        if (git_dir / "HEAD").is_file() and (git_dir / "objects").is_dir():
            out = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"], capture_output=True,
                                 text=True)
            if out.returncode == 0:
                return out.stdout
    pytest.skip(f"the public code of {repo} ({path}) is not here: clone https://github.com/{repo} into "
                f"${ENV}/{repo.replace('/', '+')} (or {SHARED}) to compare against it")


def stub(name: str, **attrs) -> types.ModuleType:
    """A module ``name`` holding ``attrs`` (a stand-in for an import the compared code does not exercise)."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def load_module(repo: str, path: str, name: str, stubs: dict[str, types.ModuleType] | None = None,
                package: str | None = None) -> types.ModuleType:
    """Execute ``path`` of ``repo`` as module ``name`` (in ``package``, for its relative imports), with ``stubs``
    in ``sys.modules`` while it imports; the module is not left in ``sys.modules``."""
    source = read_source(repo, path)
    module = types.ModuleType(name)
    module.__file__ = f"{repo}/{path}"
    module.__package__ = package or name.rpartition(".")[0]
    stubs = dict(stubs or {}, **{name: module})  # itself too, while it runs (dataclasses look their module up)
    for parent in {n.rsplit(".", i)[0] for n in list(stubs) + [name] for i in range(1, n.count(".") + 1)}:
        stubs.setdefault(parent, stub(parent))
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module

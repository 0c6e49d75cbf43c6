"""The kernel cache runs nothing another user could have planted (issue 27 item 1).

A library loaded by ctypes runs its constructors in the loading process. Each case plants, under the exact name the
DnA kernel is cached by, a library whose constructor creates a marker file, next to a record with the right
hashes, so that only the ownership and mode checks stand between it and the process; a fresh interpreter then asks
for the kernel. The marker must never appear: the kernel is refused with the reason (which an explicit request
for it raises as a ConfigError), or, for a library of this user that does not match its record, built again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import forked
import pytest

from attnlab.ops import ckernel

OTHER_UID = 4242  # a user that is not the one running the tests

PLANTED = textwrap.dedent("""
    #include <stdio.h>
    __attribute__((constructor)) static void planted(void) {
        FILE *f = fopen(MARKER, "w");
        if (f) { fputs("the planted library ran\\n", f); fclose(f); }
    }
    long attnlab_abi(void) { return 1; }
""")

# argv: a JSON list of (case, cache directory); prints a JSON dict case -> [kernel reason or None, explicit error]
PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    from attnlab.errors import ConfigError
    from attnlab.ops import ckernel, dna_cpu
    from attnlab.attention.dna import DnAAttention

    out = {}
    m = DnAAttention(32, 2, backend="kernel").eval()  # the fused CPU kernel, forced
    x = torch.randn(1, 8, 32)
    for case, cache in json.loads(sys.argv[1]):
        os.environ["ATTNLAB_CACHE"] = cache
        ckernel._libs.clear(); ckernel._errors.clear()
        try:
            with torch.no_grad():
                m(x)
            explicit = None
        except ConfigError as err:
            explicit = str(err)
        out[case] = [dna_cpu.unavailable(), explicit]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def compiler():
    cc = os.environ.get("CC", "cc")
    why = ckernel.disabled() or (None if shutil.which(cc) else f"no C compiler ({cc!r} is not on PATH)")
    if why:
        pytest.skip(why)
    return cc


@pytest.fixture(scope="module")
def genuine(tmp_path_factory, compiler) -> Path:
    """A cache holding the genuinely built DnA kernel and its record, built in a fresh process."""
    cache = tmp_path_factory.mktemp("genuine") / "cache"
    env = dict(os.environ, ATTNLAB_CACHE=str(cache))
    proc = forked.run([sys.executable, "-c", "from attnlab.ops import dna_cpu; print(dna_cpu.unavailable())"],
                      env=env, capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip() == "None", proc.stdout + proc.stderr
    return cache


def _plant(genuine: Path, cache: Path, marker: Path, compiler: str, *, record_matches: bool = True) -> Path:
    """``cache``: a copy of the genuine cache whose DnA library is replaced by the planted one (and its record by
    one that names the planted bytes, unless ``record_matches`` is False). Returns the planted library's path."""
    shutil.copytree(genuine, cache)
    (lib,) = cache.glob("dna_kernel_*.so")
    src = cache.parent / f"{cache.name}-planted.c"
    src.write_text(PLANTED)
    subprocess.run([compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)], check=True)
    record_path = lib.with_name(lib.name + ".sha256")
    record = json.loads(record_path.read_text())
    if record_matches:
        record["library"] = hashlib.sha256(lib.read_bytes()).hexdigest()
    record_path.write_text(json.dumps(record))
    return lib


def _probe(cases: dict[str, Path]) -> dict[str, list]:
    proc = forked.run([sys.executable, "-c", PROBE, json.dumps([[c, str(p)] for c, p in cases.items()])],
                      capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.compiler
def test_a_planted_library_is_never_loaded(tmp_path, genuine, compiler):
    markers, cases = {}, {}
    for case in ("dir-world-writable", "dir-of-another-user", "library-of-another-user", "record-of-another-user",
                 "library-world-writable", "ours-not-matching-its-record"):
        markers[case] = tmp_path / f"{case}.ran"
        cases[case] = tmp_path / case / "cache"
        (tmp_path / case).mkdir()
        lib = _plant(genuine, cases[case], markers[case], compiler,
                     record_matches=case != "ours-not-matching-its-record")
        cache = cases[case]
        if case == "dir-world-writable":
            cache.chmod(0o777)
        elif case == "dir-of-another-user":
            os.chown(cache, OTHER_UID, OTHER_UID)
        elif case == "library-of-another-user":
            os.chown(lib, OTHER_UID, OTHER_UID)
        elif case == "record-of-another-user":
            os.chown(lib.with_name(lib.name + ".sha256"), OTHER_UID, OTHER_UID)
        elif case == "library-world-writable":
            lib.chmod(0o777)
    if os.geteuid() != 0:  # only root can give files away; the mode cases stand for them
        for case in ("dir-of-another-user", "library-of-another-user", "record-of-another-user"):
            del cases[case]

    results = _probe(cases)
    assert not any(m.exists() for m in markers.values()), [c for c, m in markers.items() if m.exists()]
    for case, (reason, explicit) in results.items():
        if case == "ours-not-matching-its-record":  # this user's file, stale or damaged: built again and used
            assert reason is None and explicit is None, (case, reason, explicit)
            (lib,) = cases[case].glob("dna_kernel_*.so")
            assert hashlib.sha256(lib.read_bytes()).hexdigest() == json.loads(
                lib.with_name(lib.name + ".sha256").read_text())["library"]
            continue
        words = "belongs to another user" if "another-user" in case else "can be written by group or others"
        assert reason and reason.startswith("the fused CPU kernel is not used") and words in reason, (case, reason)
        assert len(reason.splitlines()) == 1
        assert explicit and reason in explicit, (case, explicit)  # backend="kernel": a ConfigError with the reason
    # a foreign-writable cache is refused, never repaired and then trusted
    assert stat.S_IMODE(cases["dir-world-writable"].stat().st_mode) == 0o777


@pytest.mark.compiler
def test_the_genuine_cache_is_private_and_recorded(genuine):
    (lib,) = genuine.glob("dna_kernel_*.so")
    assert stat.S_IMODE(genuine.stat().st_mode) & 0o077 == 0
    for path in (lib, lib.with_name(lib.name + ".sha256")):
        assert path.stat().st_uid == os.getuid() and stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    record = json.loads(lib.with_name(lib.name + ".sha256").read_text())
    assert record["library"] == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert lib.name.startswith("dna_kernel_" + record["source"][:16])
    assert not list(genuine.glob(".build-*"))  # the private build directory is gone

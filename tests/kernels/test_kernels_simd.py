"""The generated code of the whole-tensor kernels: packed vector instructions and streaming
stores, for AVX2 and for AVX-512 targets alike (compiled, not run, for the latter)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
from llvmlite import binding as llvm

# Compiles the kernels into a fresh cache (inspect_asm refuses cache-loaded code) and prints,
# per kernel, the registers and instructions of its code.
PROBE = r"""
import json, re, numba, numpy as np
from testbed.kernels import fixedpoint as fp, reductions as red
from testbed.kernels.compressors import fp16, qsgd, signsgd
x = np.ones(1000, np.float32); q = np.empty(1000, np.int32); o = np.empty(1000, np.float32)
e = np.zeros(4, np.int16)
cases = {
    "quantize_chunks": (fp._scale_chunks, (x, e, 8, 256, q, True, False)),
    "dequantize_chunks": (fp._scale_chunks, (q, e, 8, 256, o, True, True)),
    "atp_quantize": (fp._atp_quantize, (x, 1e6, q, True)),
    "atp_dequantize": (fp._atp_dequantize, (q, 1e6, o, True)),
    "sign_words": (signsgd._sign_words.serial, (x, np.empty(125, np.uint8))),
    "l2_chunk_sums": (red._chunk_sums.serial, (x, 2)),
    "qsgd_quantize": (qsgd.qsgd_quantize.serial, (x, 256, 1.0, np.uint64(7),
                                                  np.empty(1000, np.int16))),
}
if fp16.HW_HALF:
    cases["fp16_encode"] = (fp16._encode_hw.serial, (x, np.empty(1000, np.uint16)))
out = {}
for name, (f, args) in cases.items():
    sig = tuple(numba.typeof(a) for a in args)
    f.compile(sig)
    asm = f.inspect_asm(sig)
    out[name] = {"ymm": asm.count("%ymm"), "zmm": asm.count("%zmm"),
                 "nt": len(re.findall(r"\bvmovnt", asm)),
                 "pextrb": asm.count("vpextrb"),
                 "packed": sorted(set(re.findall(r"^\s+(v\w+)\s+[^\n]*%[yz]mm", asm, re.M)))}
print(json.dumps(out))
"""

AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "evex512")


def _probe(tmp_path, cpu_name=None, extra_features=()):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "PATH": "/usr/bin:/bin"}
    if cpu_name:
        features = llvm.get_host_cpu_features()
        for f in extra_features:
            features[f] = True
        env["NUMBA_CPU_NAME"] = cpu_name
        env["NUMBA_CPU_FEATURES"] = features.flatten()
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


needs_avx2 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or not llvm.get_host_cpu_features().get("avx2", False),
    reason="checks x86 vector code; this host is not an x86-64 with AVX2")


def _check(report, reg):
    for name, r in report.items():
        assert r[reg] > 0, f"{name}: no {reg} registers, not vectorised: {r}"
        assert r["pextrb"] == 0, f"{name}: mask built bit by bit: {r}"
    for name in ("quantize_chunks", "dequantize_chunks", "atp_quantize", "atp_dequantize",
                 "fp16_encode", "qsgd_quantize"):
        if name in report:
            assert report[name]["nt"] > 0, f"{name}: no streaming stores: {report[name]}"
    q = report["quantize_chunks"]["packed"]
    assert {"vcvtps2pd", "vmulpd", "vcvtpd2dq"} <= set(q), q
    assert {"vmulpd", "vaddpd"} <= set(report["l2_chunk_sums"]["packed"])
    # the element hash on 32-bit lanes, the level by a rounding conversion
    assert {"vpmulld", "vcvtps2dq"} <= set(report["qsgd_quantize"]["packed"])


@needs_avx2
def test_kernels_vectorise_on_this_host(tmp_path):
    _check(_probe(tmp_path), "ymm" if not llvm.get_host_cpu_features().get("avx512f") else "zmm")


@needs_avx2
def test_kernels_vectorise_for_avx512_targets(tmp_path):
    """The same source compiled for an AVX-512 server CPU uses 512-bit registers."""
    _check(_probe(tmp_path, "skylake-avx512", AVX512), "zmm")

"""Implementations that break the conformance protocol in the ways `streambp conform` must report (standard library
only): MODE is crash (a traceback, exit 1), nothing (exit 0, no files), rename (one tensor under another name), nan
(one entry NaN), extra (an unexpected tensor), hang (never returns: --timeout or Ctrl-C must end it; its pid goes to
the file $CONFORM_FAULTY_PID_FILE when set), perturb (the protocol kept, one tensor's gradient scaled by 1 + 1e-6 in
fp64 cases and by 1.1 otherwise: the judgement must fail it), nan-loss (result.json's loss NaN, as json.dumps writes
it), half-count (the loss and every gradient doubled: divided by half the target count), fp32 (an fp64 case's
gradients returned in fp32: right values, the wrong dtype), shape (a matrix's gradient returned flattened: its
values, the wrong shape), chunk-shift (the gradients of a loss that shifts its labels inside each head tile after
splitting: the harness's own on a copy of the case whose labels at every multiple of the head chunk are -100). The
other modes' gradients
are the harness's own (streambp_adapter.py), then corrupted.

Usage: python3 conform_faulty_adapter.py MODE STREAMBP_BIN CASE_DIR
"""
import json
import math
import os
import struct
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

mode, binary, case_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if mode == "crash":
    raise RuntimeError("the implementation crashed")
if mode == "nothing":
    sys.exit(0)
if mode == "hang":
    # its last words before hanging, then a progress bar redrawn with carriage returns (tqdm's): the timeout quotes
    # the words, never the bar
    print("loading the model", file=sys.stderr)
    sys.stderr.write("Loading weights:  50%|#####     | 1/2 [00:01<00:01,  1.00it/s]\r"
                     "Loading weights: 100%|##########| 2/2 [00:02<00:00,  1.00it/s]")
    sys.stderr.flush()
    if "CONFORM_FAULTY_PID_FILE" in os.environ:
        Path(os.environ["CONFORM_FAULTY_PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(3600)



def drop_tile_crossing_labels(batch_file, chunk):
    """labels [B, T] int64 in a safetensors file: -100 at every multiple of `chunk` but 0, in place."""
    raw = bytearray(batch_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8:8 + n])["labels"]
    assert entry["dtype"] == "I64", entry
    rows, T = entry["shape"]
    start = 8 + n + entry["data_offsets"][0]
    for b in range(rows):
        for t in range(chunk, T, chunk):
            struct.pack_into("<q", raw, start + 8 * (b * T + t), -100)
    batch_file.write_bytes(bytes(raw))


adapter = Path(__file__).resolve().parents[2] / "verify" / "conform" / "streambp_adapter.py"
run_dir = case_dir
if mode == "chunk-shift":
    run_dir = Path(tempfile.mkdtemp(prefix="chunk-shift-", dir=case_dir.parent))
    shutil.copytree(case_dir, run_dir, dirs_exist_ok=True)
    drop_tile_crossing_labels(run_dir / "batch.safetensors", json.loads((case_dir / "case.json").read_text())["chunks"]["head"])
done = subprocess.run([sys.executable, str(adapter), "--streambp", binary, str(run_dir)])
if mode == "chunk-shift":
    for name in ("grads.safetensors", "result.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, case_dir / name)
    shutil.rmtree(run_dir)
    sys.exit(done.returncode)
if done.returncode:  # 3: a case the harness's adapter declines stays N/A here too
    sys.exit(done.returncode)
result = case_dir / "result.json"
if mode in ("nan-loss", "half-count"):
    written = json.loads(result.read_text())  # its other keys kept (a micro-batch step's count)
    written["loss"] = math.nan if mode == "nan-loss" else 2 * written["loss"]
    result.write_text(json.dumps(written))
    if mode == "nan-loss":
        sys.exit(0)
grads = case_dir / "grads.safetensors"
raw = grads.read_bytes()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
data = bytearray(raw[8 + n:])
names = sorted(k for k in header if k != "__metadata__")
if mode == "rename":
    header[names[0] + ".renamed"] = header.pop(names[0])
elif mode == "extra":
    entry = dict(header[names[0]])
    start, end = entry["data_offsets"]
    entry["data_offsets"] = [len(data), len(data) + end - start]
    data += data[start:end]
    header["model.not_a_parameter"] = entry
elif mode == "shape":
    name = next(k for k in names if len(header[k]["shape"]) > 1)
    header[name]["shape"] = [math.prod(header[name]["shape"])]
elif mode == "nan":
    start, _ = header[names[0]]["data_offsets"]
    fmt = {"F64": "<d", "F32": "<f"}[header[names[0]]["dtype"]]
    struct.pack_into(fmt, data, start, math.nan)
elif mode in ("perturb", "half-count"):
    for name in names[-1:] if mode == "perturb" else names:
        fmt = {"F64": "<d", "F32": "<f", "BF16": None}[header[name]["dtype"]]
        start, end = header[name]["data_offsets"]
        scale = 2 if mode == "half-count" else 1 + 1e-6 if fmt == "<d" else 1.1
        if fmt is None:  # bf16: the upper half of an fp32
            for at in range(start, end, 2):
                (value,) = struct.unpack("<f", b"\0\0" + bytes(data[at:at + 2]))
                data[at:at + 2] = struct.pack("<f", value * scale)[2:]
        else:
            for at in range(start, end, struct.calcsize(fmt)):
                (value,) = struct.unpack_from(fmt, data, at)
                struct.pack_into(fmt, data, at, value * scale)
elif mode == "fp32":  # every F64 tensor rewritten as F32, the offsets laid out again
    packed = bytearray()
    for name in names:
        entry = header[name]
        start, end = entry["data_offsets"]
        if entry["dtype"] == "F64":
            values = struct.unpack(f"<{(end - start) // 8}d", data[start:end])
            chunk = struct.pack(f"<{len(values)}f", *values)
            entry["dtype"] = "F32"
        else:
            chunk = bytes(data[start:end])
        entry["data_offsets"] = [len(packed), len(packed) + len(chunk)]
        packed += chunk
    data = packed
else:
    sys.exit(f"unknown mode {mode}")
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
grads.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))

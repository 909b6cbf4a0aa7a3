"""The log's columns (SCHEMA), the packed binary row every recorded call becomes, and the
bit fields inside it. The lowest layer: no torch, no pandas; numpy only inside functions."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# FLAGS bits. F_DEVICE: the tensors are on the process's accelerator (named in the log's
# "device" record; files written before it was named mean CUDA).
F_ASYNC, F_DEVICE, F_ERROR = 1, 2, 4
T_SHIFT = 4  # timing code lives in bits 4..7
# Timing sources, by code. Code 2 was called "cuda_event" before any accelerator could use it:
# files that say so are read as device_event (OLD_TIMING_NAMES).
TIMINGS = ("host", "future", "device_event", "nccl", "none", "wait")
T_HOST, T_FUTURE, T_DEVICE, T_NCCL, T_NONE, T_WAIT = range(6)
OLD_TIMING_NAMES = {"cuda_event": "device_event"}

# The binary row: (field, struct code) in tuple order, little-endian, no padding.
_FIELDS = (
    ("seq", "q"),
    ("op", "h"),
    ("gid", "h"),
    ("dtype", "h"),
    ("numel", "q"),
    ("flags", "B"),
    ("start", "q"),
    ("end", "q"),
    ("peer", "i"),
    ("step", "q"),
    ("tag", "i"),
    ("where", "i"),
)
ROW = struct.Struct("<" + "".join(code for _, code in _FIELDS))
_NP_CODES = {"q": "<i8", "i": "<i4", "h": "<i2", "B": "u1"}


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # pandas dtype of the DataFrame column (and of the CSV round trip)
    unit: str
    doc: str


SCHEMA: tuple[Column, ...] = (
    Column("seq", "int64", "", "per-process sequence number of the call (0, 1, 2, ...)"),
    Column(
        "op",
        "category",
        "",
        "what commpatch recorded: the torch.distributed function's name (e.g. all_reduce), or source.name for rows an integration records (funcol.all_gather, coalesced.all_reduce, ddp_bucket_allreduce)",
    ),
    Column(
        "collective",
        "category",
        "",
        "the collective that ran, as nccl-tests names it: all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, gather, scatter, barrier, send, recv, send_recv (derived from op)",
    ),
    Column(
        "api",
        "category",
        "",
        "the function actually called, torch's own name (all_gather_into_tensor, _broadcast_coalesced, Reducer.allreduce, ...; derived from op)",
    ),
    Column(
        "source",
        "category",
        "",
        "who issued it: c10d (a torch.distributed call), ddp (DDP's reducer), funcol (functional collectives: DTensor, tensor parallel), coalescing, compiled (a torch.compile'd graph) (derived from op)",
    ),
    Column("rank", "int64", "", "global rank of the process that made the call"),
    Column("world_size", "int64", "", "size of the default process group"),
    Column("group", "category", "", "process group name ('0' is the default group)"),
    Column("group_size", "int64", "", "number of ranks in the group used by the call"),
    Column(
        "group_ranks",
        "category",
        "",
        "global ranks of that group in range notation: '0-1023', '0-1022:2' (first-last[:step] for runs of 3 or more), other ranks space separated ('0 3 5')",
    ),
    Column(
        "group_seq",
        "int64",
        "",
        "sequence number of the call within its group on this rank (matches the same collective across ranks)",
    ),
    Column(
        "backend",
        "category",
        "",
        "backend that ran the call: the group's backend for the tensors' device (gloo, nccl, or a registered backend's name); a group configured 'cpu:gloo,cuda:nccl' shows gloo or nccl per row",
    ),
    Column(
        "device",
        "category",
        "",
        "device type of the tensors: cpu, the accelerator's type (cuda, xpu, hpu, mtia, npu, or a PrivateUse1 device's name), or none",
    ),
    Column("dtype", "category", "", "element type ('object' for object collectives, 'none' when no tensor)"),
    Column("numel", "int64", "elements", "elements in the message S (see bytes)"),
    Column(
        "bytes",
        "int64",
        "bytes",
        "message size S as nccl-tests counts it: all_reduce the tensor, all_gather the full output, reduce_scatter the full input, all_to_all the total; for object collectives the bytes of the tensors they moved",
    ),
    Column(
        "peer", "int64", "", "global rank of the peer (send/recv) or root (broadcast/reduce/gather/scatter); -1 if none"
    ),
    Column("async_op", "bool", "", "the call was asynchronous (returned a Work)"),
    Column("start_ns", "int64", "ns", "Unix time when the call was issued"),
    Column("host_us", "float64", "us", "wall time spent inside the Python call"),
    Column("duration_us", "float64", "us", "duration from the source named in 'timing' (NaN when unknown)"),
    Column(
        "own_us",
        "float64",
        "us",
        "the collective's own time: completion minus the later of its issue and the completion of the previous call on the same group (on the device for device_event rows), so time spent queued behind earlier calls is not counted; NaN when unknown",
    ),
    Column(
        "timing",
        "category",
        "",
        "source of duration_us: host (the Python call), future (a CPU Work's completion callback), device_event (events on the accelerator's stream; 'cuda_event' in older files), nccl (NCCL's own kernel timing), wait, or none",
    ),
    Column("algbw_gbps", "float64", "GB/s", "bytes / own_us (1e9 bytes per second)"),
    Column("busbw_gbps", "float64", "GB/s", "algbw times the nccl-tests bus factor for the op and group size"),
    Column("status", "category", "", "ok, or error when torch raised"),
    Column(
        "step",
        "int64",
        "",
        "training step of the call: counted automatically (each optimizer.step(), else each forward of a DDP / FSDP root module) unless commpatch.step() sets it; with none of them, the analysis numbers the iterations of a repeating pattern of collectives (step 0: the calls before it); see step_source",
    ),
    Column("tag", "category", "", "innermost commpatch.tag() active when the call was issued"),
    Column("pid", "int64", "", "process id"),
    Column(
        "module",
        "category",
        "",
        "fully qualified name of the innermost nn.Module running when the call was issued (forward), or of the root module whose backward issued it; '' outside modules",
    ),
    Column("phase", "category", "", "forward, backward, optimizer (inside optimizer.step) or other"),
    Column("bucket", "int64", "", "DDP gradient bucket index the call reduced; -1 if none"),
    Column("bucket_params", "int64", "", "number of parameters in that DDP bucket; 0 if none"),
    Column(
        "tensors",
        "int64",
        "",
        "calls coalesced into this row by _coalescing_manager (coalesced.* rows); 1 for every other row",
    ),
    Column(
        "step_source",
        "category",
        "",
        "what counted the step: optimizer (optimizer.step), forward (a DDP / FSDP root module's forward), user (commpatch.step()), none (no step boundary seen yet), pattern (no step boundary in the rank's log: the analysis found the period of its calls, keyed by op, group and bytes, and numbered its iterations; never recorded)",
    ),
    Column(
        "sync_end_us",
        "float64",
        "us",
        "DDP on CPU, on the ddp_bucket_allreduce row of a backward's last bucket: when the reducer's finalize after that backward ended (it waits for every bucket's all-reduce, then copies the averaged gradients into .grad), in us after the row's start_ns; NaN on other rows",
    ),
    Column(
        "pack_us",
        "float64",
        "us",
        "DDP on CPU, on a gradient bucket's (first) row: host time the training thread spent in the reducer's hooks on the gradients ready since the previous bucket's launch (copying each into its bucket), each timed from its accumulation to the end of the reducer's hook or to this bucket's launch; NaN on other rows",
    ),
    Column(
        "pack_alone_us",
        "float64",
        "us",
        "the part of pack_us with none of the model's buckets in flight: what the packing adds to the wall time with communication under way (busy_us); NaN where pack_us is",
    ),
    Column(
        "wait_us",
        "float64",
        "us",
        "functional collectives (timing wait: DTensor, tensor parallel, compiled graphs): host time the thread spent inside the wait_tensor that completed the call (it ends at start_ns + duration_us): the time it waited for the collective, exposed; NaN on other rows and where that wait was not seen",
    ),
)
COLUMNS = tuple(c.name for c in SCHEMA)

# Schema version: bumped whenever columns are added (columns are never renamed, retyped or
# removed). ADDED_IN names the version that added a column (the others are in version 1).
# Parquet files carry the version in their key-value metadata (SCHEMA_VERSION_KEY); a CSV's
# header is its schema: readers go by column names, and fill columns a file predates.
SCHEMA_VERSION = 7
SCHEMA_VERSION_KEY = b"commpatch.schema_version"
ADDED_IN = {
    "module": 2,
    "phase": 2,
    "bucket": 2,
    "bucket_params": 2,
    "collective": 3,
    "api": 3,
    "source": 3,
    "tensors": 3,
    "own_us": 4,
    "step_source": 4,
    "sync_end_us": 5,
    "pack_us": 6,
    "pack_alone_us": 6,
    "wait_us": 7,
}
DERIVED_FROM_OP = ("collective", "api", "source")  # a file that predates them gets them from op


PHASES = ("other", "forward", "backward", "optimizer")
P_FORWARD, P_BACKWARD, P_OPTIMIZER = 1, 2, 3
# what advanced the step counter (record.state.STATE.step_source; a "step_source" meta record per change).
# "pattern" is never recorded: the offline analysis (analysis.pattern) gives it to rows it numbered.
STEP_SOURCES = ("none", "user", "optimizer", "forward", "pattern")
S_NONE, S_USER, S_OPTIMIZER, S_FORWARD, S_PATTERN = range(5)
# the step boundaries a log records: a rank with none of them (constant step) gets its steps offline
BOUNDARY_SOURCES = tuple(STEP_SOURCES[s] for s in (S_USER, S_OPTIMIZER, S_FORWARD))
# df.attrs key: with a window of steps, the ranks io.read kept whole (no step boundary); the other
# ranks' rows were cut, so a constant step there is the window's, not a missing boundary
STEPLESS_ATTR = "stepless_ranks"


# ---- the packed bit fields of a row ----------------------------------------------------------
def pack_flags(async_op, device, err, tcode: int) -> int:
    """The ``flags`` byte: F_ASYNC | F_DEVICE | F_ERROR bits, the timing code in bits 4..7."""
    return (async_op and F_ASYNC) | (device and F_DEVICE) | (err and F_ERROR) | (tcode << T_SHIFT)


def unpack_flags(flags):
    """(async_op, on the accelerator, err, timing code) of a ``flags`` value (an int or a numpy array)."""
    return flags & F_ASYNC, flags & F_DEVICE, (flags & F_ERROR) >> 2, flags >> T_SHIFT


def pack_where(module: int, phase: int) -> int:
    """The ``where`` field: module code << 2 | phase code (an index into PHASES)."""
    return module << 2 | phase


def unpack_where(where):
    """(module code, phase code) of a ``where`` value (an int or a numpy array)."""
    return where >> 2, where & 3


def row_dtype(np):
    """numpy dtype of one packed row (the same layout as ROW)."""
    return np.dtype([(name, _NP_CODES[code]) for name, code in _FIELDS])


def printable_name(name: str) -> str:
    """A tag or module name as every file format can hold it: what UTF-8 cannot encode (lone
    surrogates, how Python carries undecodable file names) and NUL bytes are backslash-escaped."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name.replace("\x00", "\\x00") if "\x00" in name else name


def compact_ranks(ranks) -> str:
    """Global ranks of a group in range notation: '0-7', '0-1022:2', '0 3 5' (runs of equal step
    of 3 or more become 'first-last[:step]'), so a row's group costs the same at 8 or 8,192 ranks."""
    ranks = list(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i + 1
        if j < len(ranks):
            step = ranks[j] - ranks[i]
            while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
                j += 1
            if j - i >= 2 and step > 0:
                parts.append(f"{ranks[i]}-{ranks[j]}" + (f":{step}" if step != 1 else ""))
                i = j + 1
                continue
        parts.append(str(ranks[i]))
        i += 1
    return " ".join(parts)


def expand_ranks(text) -> list[int]:
    """The ranks of a ``group_ranks`` value (range notation or the older space-separated list)."""
    out: list[int] = []
    for part in str(text).split():
        if "-" in part:
            span, _, step = part.partition(":")
            first, _, last = span.partition("-")
            out.extend(range(int(first), int(last) + 1, int(step or 1)))
        else:
            out.append(int(part))
    return out

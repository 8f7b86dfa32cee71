"""One measured job, run in a fresh process by ``bench/run.py``; prints one JSON line.

    python bench/_job.py weightmap SRC DST (--mapping FILE | --preset NAME) [--torch]
                                                [--direct]
    python bench/_job.py inplace SRC --mapping FILE --back FILE
    python bench/_job.py naive SRC DST OP        # OP: rename, to-f32, to-bf16, split, transpose
    python bench/_job.py cp SRC DST [--fsync]
    python bench/_job.py naive-ranks SRC DST     # Meta's rank files joined as write_model
    python bench/_job.py peft BASE ADAPTER DST   # peft's merge_and_unload (bench/README.md)
    python bench/_job.py direct-write DST BYTES  # the disk's limit: O_DIRECT, 2 threads, fsync
    python bench/_job.py in-memory SRC OP        # torch's op on loaded tensors (to-f32, transpose)

Only the operation is timed (``seconds``); imports happen before the clock starts and
``startup`` is the time from interpreter start to the clock starting. ``rss_peak`` is
``ru_maxrss`` (MiB) of this process (``rss_base``: the same just before the operation; ``hwm``:
VmHWM, the peak of this address space alone, which ``ru_maxrss`` exceeds only by what the
launching process held when it started this one). For ``cp``, ``rss_peak`` is the child's
VmHWM sampled from /proc. A sampling thread records the largest anonymous and file-backed
resident sizes seen (``anon_peak``, ``file_peak``), to tell private memory from pages of a
memory-mapped input, which ``ru_maxrss`` counts too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STARTED = time.perf_counter()
_MIB = 1024.0  # ru_maxrss is in KiB on Linux
SPLIT_NAME = "layers.0.self_attn.qkv_proj.weight"
TRANSPOSE_NAME = "fc.weight"


class Sampler:
    """Largest RssAnon / RssFile of this process, read from /proc every few milliseconds."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.anon = 0
        self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        try:
            with open("/proc/self/status", "rb") as f:
                for line in f:
                    if line.startswith(b"RssAnon:"):
                        self.anon = max(self.anon, int(line.split()[1]))
                    elif line.startswith(b"RssFile:"):
                        self.file = max(self.file, int(line.split()[1]))
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()

    def __enter__(self) -> Sampler:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


def _maxrss(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / _MIB


def _hwm(pid: int | str = "self") -> float | None:
    """VmHWM (MiB): the peak RSS of the process's own address space, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / _MIB
    except OSError:
        pass
    return None


def _cpu(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _sys(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_stime


def _measure(op: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    base = _maxrss()
    startup = time.perf_counter() - _STARTED
    with Sampler() as sampler:
        cpu0, sys0 = _cpu(), _sys()
        t0 = time.perf_counter()
        extra = op()
        seconds = time.perf_counter() - t0
        cpu, system = _cpu() - cpu0, _sys() - sys0
    return {
        "seconds": seconds,
        "cpu": cpu,
        "sys": system,
        "startup": startup,
        "rss_base": base,
        "rss_peak": _maxrss(),
        "hwm": _hwm(),
        "anon_peak": sampler.anon / _MIB,
        "file_peak": sampler.file / _MIB,
        **extra,
    }


# -- weightmap -------------------------------------------------------------------------------


class ParserTimer:
    """Times reading mappings, every call of ``parse_program`` where mappings and presets are
    loaded: a parsed program loaded from the per-user cache, or the parser got (built, or
    loaded from its cache, once a process) and the text parsed."""

    def __init__(self) -> None:
        from weightmap.language import mapping

        self.seconds = 0.0
        real = mapping.parse_program

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        mapping.parse_program = timed


class FsyncTimer:
    """Wraps ``os.fsync`` to time how long the writer waits for the disk: the wall time during
    which at least one fsync is in progress. The writer fsyncs its shards from several threads
    at once, and a sum over threads would count overlapping waits more than once (and could
    exceed the whole conversion's time)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._real = os.fsync

    def __call__(self, fd: Any) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1
        try:
            self._real(fd)
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.seconds += time.perf_counter() - self._since


class StageTimer:
    """Times reading the checkpoint (headers, index) and compiling the plan inside remap."""

    def __init__(self) -> None:
        import weightmap.api as api
        from weightmap.inputs.checkpoint import Checkpoint

        self.open = 0.0
        self.compile = 0.0
        real_open = Checkpoint.open.__func__  # type: ignore[attr-defined]
        real_compile = api.compile_plan

        def timed_open(cls: Any, path: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_open(cls, path, *a, **k)
            finally:
                self.open += time.perf_counter() - t0

        def timed_compile(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_compile(*a, **k)
            finally:
                self.compile += time.perf_counter() - t0

        Checkpoint.open = classmethod(timed_open)  # type: ignore[method-assign,assignment]
        api.compile_plan = timed_compile  # type: ignore[assignment]


def job_weightmap(args: argparse.Namespace) -> dict[str, Any]:
    if args.direct:  # computed chunks past the page cache (opt-in)
        os.environ["WEIGHTMAP_DIRECT_IO"] = "1"
    if args.torch:
        # A computing plan needs torch; import it before the clock, as the naive script does.
        import torch  # noqa: F401

    import weightmap

    source: dict[str, Any] = (
        {"preset": args.preset} if args.preset else {"mapping": Path(args.mapping)}
    )
    if args.set:
        source["params"] = {k: json.loads(v) for k, _, v in (x.partition("=") for x in args.set)}
    if args.input:
        source["inputs"] = dict(x.split("=", 1) for x in args.input)
    timer = FsyncTimer()
    os.fsync = timer
    parser = ParserTimer()
    stages = StageTimer()

    def op() -> dict[str, Any]:
        result = weightmap.remap(args.src, args.dst, progress=False, **source)
        return {
            "module": weightmap.__file__,
            "open": stages.open,
            "compile": stages.compile,
            "bytes_written": result.bytes_written,
            "bytes_copied": result.bytes_copied,
            "bytes_cloned": getattr(result, "bytes_cloned", 0),
            "fsync": timer.seconds,
            "parser": parser.seconds,
            "torch_imported": "torch" in sys.modules,
        }

    return _measure(op)


def job_inplace(args: argparse.Namespace) -> dict[str, Any]:
    """The forward rename (timed as ``seconds``), then the backward one in the same process.

    The first call gets the rule-language parser; the second (``second``) shows the cost of
    the rewrite itself for a program that has already parsed a mapping.
    """
    import weightmap

    forward, back = Path(args.mapping), Path(args.back)
    timer = FsyncTimer()
    os.fsync = timer
    parser = ParserTimer()

    def op() -> dict[str, Any]:
        weightmap.remap(args.src, mapping=forward, inplace=True, progress=False)
        return {"fsync": timer.seconds, "parser": parser.seconds}

    result = _measure(op)
    timer.seconds = 0.0
    t0 = time.perf_counter()
    weightmap.remap(args.src, mapping=back, inplace=True, progress=False)
    result["second"] = time.perf_counter() - t0
    result["second_fsync"] = timer.seconds
    result["torch_imported"] = "torch" in sys.modules
    return result


# -- the naive script ------------------------------------------------------------------------


def job_naive(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(args.src), Path(args.dst)

    def convert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if args.op == "rename":
            return {k.replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}
        if args.op in ("to-f32", "to-bf16"):
            dtype, source = (
                (torch.float32, torch.bfloat16)
                if args.op == "to-f32"
                else (torch.bfloat16, torch.float32)
            )
            return {k: v.to(dtype) if v.dtype == source else v for k, v in sd.items()}
        if args.op == "split":
            q, k, v = (t.clone() for t in sd.pop(SPLIT_NAME).chunk(3, dim=0))
            prefix = SPLIT_NAME.removesuffix("qkv_proj.weight")
            return {**sd, prefix + "q_proj.weight": q, prefix + "k_proj.weight": k,
                    prefix + "v_proj.weight": v}  # fmt: skip
        if args.op == "transpose":
            return {**sd, TRANSPOSE_NAME: sd[TRANSPOSE_NAME].T.contiguous()}
        raise SystemExit(f"unknown naive op {args.op!r}")

    def op() -> dict[str, Any]:
        dst.mkdir()
        sd = load_file(src / "model.safetensors")
        sd = convert(sd)
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
        if (src / "config.json").exists():
            shutil.copyfile(src / "config.json", dst / "config.json")
        return {}

    return _measure(op)


def job_naive_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Meta's rank files joined as transformers' convert_llama_weights_to_hf.py (write_model,
    num_shards > 1, Llama 3) does it: every rank loaded whole, each tensor concatenated (q and
    k then permuted), the state dict saved."""
    import torch
    from safetensors.torch import save_file

    src, dst = Path(args.src), Path(args.dst)

    def op() -> dict[str, Any]:
        dst.mkdir()
        params = json.loads((src / "params.json").read_text())
        files = sorted(src.glob("consolidated.*.pth"))
        loaded = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
        n = len(loaded)
        dim, n_heads = params["dim"], params["n_heads"]
        head = dim // n_heads
        kv = params.get("n_kv_heads") or n_heads

        def permute(w: torch.Tensor, heads: int, dim1: int) -> torch.Tensor:
            return w.view(heads, dim1 // heads // 2, 2, dim).transpose(1, 2).reshape(dim1, dim)

        def cat(name: str, d: int) -> torch.Tensor:
            return torch.cat([sd[name] for sd in loaded], dim=d)

        out: dict[str, torch.Tensor] = {}
        for i in range(params["n_layers"]):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            wq = torch.cat([sd[p + "attention.wq.weight"].view(n_heads // n, head, dim)
                            for sd in loaded]).reshape(dim, dim)  # fmt: skip
            wk = torch.cat([sd[p + "attention.wk.weight"].view(kv // n, head, dim)
                            for sd in loaded]).reshape(kv * head, dim)  # fmt: skip
            out[q + "self_attn.q_proj.weight"] = permute(wq, n_heads, dim)
            out[q + "self_attn.k_proj.weight"] = permute(wk, kv, kv * head)
            out[q + "self_attn.v_proj.weight"] = cat(p + "attention.wv.weight", 0)
            out[q + "self_attn.o_proj.weight"] = cat(p + "attention.wo.weight", 1)
            out[q + "mlp.gate_proj.weight"] = cat(p + "feed_forward.w1.weight", 0)
            out[q + "mlp.down_proj.weight"] = cat(p + "feed_forward.w2.weight", 1)
            out[q + "mlp.up_proj.weight"] = cat(p + "feed_forward.w3.weight", 0)
            out[q + "input_layernorm.weight"] = loaded[0][p + "attention_norm.weight"]
            out[q + "post_attention_layernorm.weight"] = loaded[0][p + "ffn_norm.weight"]
        out["model.embed_tokens.weight"] = cat("tok_embeddings.weight", 0)
        out["model.norm.weight"] = loaded[0]["norm.weight"]
        out["lm_head.weight"] = cat("output.weight", 0)
        save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
        return {}

    return _measure(op)


def job_peft(args: argparse.Namespace) -> dict[str, Any]:
    """peft's merge_and_unload on the CPU: the base loaded with transformers, the adapter
    applied, merged, and the model saved with save_pretrained."""
    import peft  # noqa: F401
    import torch
    import transformers

    def op() -> dict[str, Any]:
        from peft import PeftModel

        model = transformers.AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16)
        merged = PeftModel.from_pretrained(model, args.adapter).merge_and_unload()
        merged.save_pretrained(args.dst, max_shard_size="100GB")
        return {}

    return _measure(op)


# -- cp --------------------------------------------------------------------------------------


def job_direct_write(args: argparse.Namespace) -> dict[str, Any]:
    """The disk's limit for an output: ``nbytes`` written into one file with O_DIRECT from
    ``threads`` threads, 32 MiB aligned blocks each (filled before the clock), then fsynced."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    block = 32 * 2**20
    dst = Path(args.dst)
    buffers = [mmap.mmap(-1, block) for _ in range(args.threads)]
    for buf in buffers:
        buf.write(os.urandom(2**20) * (block // 2**20))
    nbytes = -(-args.nbytes // 4096) * 4096

    def op() -> dict[str, Any]:
        dst.mkdir()
        fd = os.open(dst / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.ftruncate(fd, nbytes)

            def part(k: int) -> None:
                view = memoryview(buffers[k])
                for at in range(k * block, nbytes, block * args.threads):
                    os.pwrite(fd, view[: min(block, nbytes - at)], at)

            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(part, range(args.threads)))
            os.fsync(fd)
        finally:
            os.close(fd)
        folder = os.open(dst, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)
        return {}

    return _measure(op)


def job_in_memory(args: argparse.Namespace) -> dict[str, Any]:
    """torch's own operation on tensors already in memory (loaded before the clock): the
    compute a conversion cannot avoid, with no reading or writing."""
    import torch
    from safetensors.torch import load_file

    sd = {k: v.clone() for k, v in load_file(Path(args.src) / "model.safetensors").items()}

    def op() -> dict[str, Any]:
        out = {}
        for k, v in sd.items():
            if args.op == "to-f32":
                out[k] = v.to(torch.float32) if v.dtype == torch.bfloat16 else v
            else:
                out[k] = v.T.contiguous() if v.dim() == 2 else v
        return {"tensors": len(out)}

    return _measure(op)


def job_cp(args: argparse.Namespace) -> dict[str, Any]:
    """``cp -r``; its peak RSS is sampled from /proc, as ``RUSAGE_CHILDREN`` also counts this
    wrapper's own resident set at the time it started the child."""
    dst = Path(args.dst)
    hwm = 0.0
    t0 = time.perf_counter()
    child = subprocess.Popen(["cp", "-r", args.src, args.dst])
    while child.poll() is None:
        hwm = max(hwm, _hwm(child.pid) or 0.0)
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    if child.returncode:
        raise SystemExit(f"cp failed with status {child.returncode}")
    fsync = 0.0
    if args.fsync:
        t1 = time.perf_counter()
        for path in sorted(dst.iterdir()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        fsync = time.perf_counter() - t1
        seconds += fsync
    return {
        "seconds": seconds,
        "cpu": _cpu(resource.RUSAGE_CHILDREN),
        "fsync": fsync,
        "rss_peak": hwm,
        "rusage_children": _maxrss(resource.RUSAGE_CHILDREN),
        "rss_base": 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("weightmap")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--mapping")
    p.add_argument("--preset")
    p.add_argument("--torch", action="store_true", help="import torch before timing")
    p.add_argument("--set", action="append", help="KEY=JSON, a mapping param")
    p.add_argument("--input", action="append", help="NAME=PATH, a declared input")
    p.add_argument("--direct", action="store_true", help="WEIGHTMAP_DIRECT_IO=1")
    p.set_defaults(fn=job_weightmap)
    p = sub.add_parser("direct-write")
    p.add_argument("dst")
    p.add_argument("nbytes", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(fn=job_direct_write)
    p = sub.add_parser("in-memory")
    p.add_argument("src")
    p.add_argument("op", choices=["to-f32", "transpose"])
    p.set_defaults(fn=job_in_memory)
    p = sub.add_parser("naive-ranks")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(fn=job_naive_ranks)
    p = sub.add_parser("peft")
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("dst")
    p.set_defaults(fn=job_peft)
    p = sub.add_parser("inplace")
    p.add_argument("src")
    p.add_argument("--mapping", required=True, help="the forward rename (timed)")
    p.add_argument("--back", required=True, help="the rename that undoes it (timed apart)")
    p.set_defaults(fn=job_inplace)
    p = sub.add_parser("naive")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("op", choices=["rename", "to-f32", "to-bf16", "split", "transpose"])
    p.set_defaults(fn=job_naive)
    p = sub.add_parser("cp")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--fsync", action="store_true", help="fsync the copied files (timed)")
    p.set_defaults(fn=job_cp)
    args = parser.parse_args(argv)
    result = args.fn(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

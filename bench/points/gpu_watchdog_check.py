"""Check the memory watchdog against a real GPU: it must shed before VRAM runs out.

For a machine with a GPU, PyTorch and nvidia-ml-py, without vLLM or network.
It runs server.operations.watchdog.Watchdog with the real NvmlReader, while a child
process allocates VRAM with torch one chunk at a time, and checks that:

1. the state turns SHEDDING (or CRITICAL) before an allocation fails;
2. NVML's free memory fell by about what torch allocated (so the reader
   watches the device torch uses: the child gets the card by UUID);
3. after the child frees everything, the state returns to OK.

Thresholds are scaled to the card's free memory at the start (after the
child's CUDA context exists): chunk = free/12 (256 MiB..8 GiB), shed below
3 chunks free, leave above 4, critical below 1. Prints a table of
(time, torch allocated, NVML free, nvidia-smi free, state); exit 0 on pass,
1 on fail, 2 when it cannot run. Bounded: 170 s overall.

    python bench/points/gpu_watchdog_check.py [--device 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
DEADLINE_S = 170.0  # the whole check; well under 3 minutes
INTERVAL_S = 0.1  # watchdog poll interval here (250 ms in production)
DWELL_S = 1.0


# --------------------------------------------------------------------------
# The child: the only process that touches CUDA through torch.


def child_main() -> int:
    import torch

    held: list[torch.Tensor] = []
    torch.zeros(1, device="cuda")  # create the context before the parent measures
    torch.cuda.synchronize()
    print("ready", flush=True)
    allocated = 0
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "alloc":
            try:
                t = torch.empty(int(arg), dtype=torch.uint8, device="cuda")
                t.fill_(1)  # touch it
                torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError:
                print(f"oom {allocated}", flush=True)
                continue
            held.append(t)
            del t  # `held` is the only reference, so "free" really frees it
            allocated += int(arg)
            print(f"ok {allocated}", flush=True)
        elif cmd == "free":
            held.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # give it back to the driver, not just torch's cache
            allocated = 0
            print("freed 0", flush=True)
        else:
            break
    return 0


# --------------------------------------------------------------------------
# The parent: NVML only (no CUDA context of its own).


async def nvidia_smi_free_mib(device: str) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            "nvidia-smi",
            "--query-gpu=memory.free",
            "--format=csv,noheader,nounits",
            "-i",
            device,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return "n/a"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return "timeout"
    return out.decode().strip() or "?"


class Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ask(self, command: str) -> tuple[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((command + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)  # one 8 GiB alloc
        word, _, value = line.decode().strip().partition(" ")
        if not word:
            raise RuntimeError("child exited")
        return word, int(value or 0)


async def check(device_index: int) -> int:
    import pynvml

    from batching.pressure import PressureConfig, State
    from server.operations.watchdog import NvmlReader, Watchdog

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"cannot run: NVML unavailable ({exc})")
        return 2
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        name = pynvml.nvmlDeviceGetName(handle)
    finally:
        pynvml.nvmlShutdown()
    print(f"device {device_index}: {name} {uuid}")

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--child",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    child = Child(proc)
    try:
        assert proc.stdout is not None
        ready = await asyncio.wait_for(proc.stdout.readline(), 90)
        if ready.strip() != b"ready":
            print("cannot run: the torch child did not start")
            return 2

        reader = NvmlReader(uuid)  # the same card as the child, by UUID
        first = await asyncio.to_thread(reader.read)
        if not isinstance(first, tuple) or len(first) != 1:
            print(f"cannot run: NvmlReader gave {first!r}")
            return 2
        free0 = first[0].free
        chunk = min(8 * GIB, max(256 * MIB, free0 // 12)) // MIB * MIB
        cfg = PressureConfig(
            gpu_critical_free_mib=chunk // MIB,
            gpu_shed_free_mib=3 * chunk // MIB,
            gpu_leave_free_mib=4 * chunk // MIB,
            # Host RAM is not under test here: thresholds it cannot reach.
            host_critical_available_mib=0,
            host_shed_available_mib=1,
            host_leave_available_mib=2,
            min_dwell=DWELL_S,
        )
        if free0 // MIB <= cfg.gpu_leave_free_mib:
            print(f"cannot run: only {free0 // MIB} MiB free")
            return 2
        print(
            f"free at start {free0 // MIB} MiB; chunk {chunk // MIB} MiB; shed < "
            f"{cfg.gpu_shed_free_mib}, leave > {cfg.gpu_leave_free_mib}, "
            f"critical < {cfg.gpu_critical_free_mib} MiB free"
        )

        wd = Watchdog(gpu=reader, config=cfg, interval=INTERVAL_S)
        rows: list[tuple[float, int, str, str, str]] = []
        t0 = time.monotonic()
        allocated = 0

        async def settle_and_record() -> None:
            await asyncio.sleep(3 * INTERVAL_S)  # at least two full polls
            latest = wd.latest
            nv = "?"
            if latest is not None and isinstance(latest.gpus, tuple) and latest.gpus:
                nv = str(latest.gpus[0].free // MIB)
            smi = await nvidia_smi_free_mib(uuid)
            rows.append((time.monotonic() - t0, allocated, nv, smi, wd.state.name))

        failures: list[str] = []
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(wd.run())
            await settle_and_record()
            if wd.state is not State.OK:
                failures.append("not OK before allocating")
            for _ in range(64):
                if wd.state is not State.OK:
                    break
                word, allocated = await child.ask(f"alloc {chunk}")
                if word == "oom":
                    failures.append("allocation failed before the state left OK")
                    break
                await settle_and_record()
            shed_at = allocated
            if wd.state is State.OK:
                failures.append("never left OK")
            else:
                latest = wd.latest
                assert latest is not None and isinstance(latest.gpus, tuple)
                drop = free0 - latest.gpus[0].free
                # NVML must see what torch allocated (10% slack for allocator rounding).
                if drop < 0.9 * shed_at:
                    failures.append(f"NVML free fell {drop // MIB} MiB for {shed_at // MIB} MiB")
            word, allocated = await child.ask("free")
            deadline = time.monotonic() + DWELL_S + 10.0
            while time.monotonic() < deadline:
                await settle_and_record()
                if wd.state is State.OK:
                    break
            if wd.state is not State.OK:
                failures.append("did not return to OK after freeing")
            task.cancel()

        print(f"\n{'t (s)':>7} {'torch alloc MiB':>16} {'nvml free':>10} {'smi free':>9}  state")
        for t, alloc, nv, smi, state in rows:
            print(f"{t:7.2f} {alloc // MIB:16d} {nv:>10} {smi:>9}  {state}")
        if failures:
            print("\nFAIL: " + "; ".join(failures))
            return 1
        print(f"\nPASS: shed after {shed_at // MIB} MiB allocated, back to OK after freeing")
        return 0
    finally:
        if proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", type=int, default=0, help="NVML (nvidia-smi) index")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    async def bounded() -> int:
        try:
            async with asyncio.timeout(DEADLINE_S):
                return await check(args.device)
        except TimeoutError:
            print(f"FAIL: not finished within {DEADLINE_S:.0f} s")
            return 1

    return asyncio.run(bounded())


if __name__ == "__main__":
    sys.exit(main())

"""A network of slow links on this machine: one network namespace per node, each joined to a bridge
(in a namespace of its own) by a veth pair whose two ends are shaped with `tc ... tbf` to a rate, so
that a node's upload and download are both limited, as on a home internet link. Needs root on Linux
(`ip` and `tc` from iproute2). Traffic stays inside the namespaces; nothing touches the host's
interfaces.

    with NetLab(nodes=3, rate_mbit=10) as lab:
        process = lab.popen(0, ["python", "-m", "http.server"])   # runs inside node 0's namespace
        lab.address(0)                                            # "10.77.0.1"
        lab.counters(0)                                           # (bytes sent, bytes received)

`homes` puts nodes behind a home router each, as most volunteers are: the node's namespace holds
a private network (10.100+i.0.0/24) whose router namespace sits on the bridge and masquerades its
traffic (iptables MASQUERADE), forwarding nothing inbound but the replies to connections made from
inside (FORWARD policy DROP, ESTABLISHED,RELATED accepted), and no port forwarding: nodes behind two
routers cannot dial each other, and nobody dials them. With `homes`, the bridge's addresses are in the
benchmark range 198.18.0.0/15 (RFC 2544), which no software treats as global:

    with NetLab(nodes=3, rate_mbit=None, homes=[1, 2]) as lab:
        lab.address(0)        # "198.18.0.1": public
        lab.address(1)        # "198.18.0.2": node 1's router, the address others see it from
        lab.lan_address(1)    # "10.101.0.2": node 1's own address, behind it

Everything is removed on exit, on an exception, and on Ctrl-C or SIGTERM (the caller turns SIGTERM
into an exception: `raise_on_sigterm`). Namespaces left by a process that was killed outright are
removed by the next NetLab (`remove_stale`): their names carry the pid of their owner.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

SUBNET = "10.77.0"
PUBLIC_SUBNET = "198.18.0"  # the bridge's addresses when some nodes sit behind a home router
NAME = re.compile(r"^shl(\d+)-")


class NetLabError(RuntimeError):
    """The namespaces could not be built (not root, no iproute2, ...); the message says why."""


def available(*, nat: bool = False) -> str | None:
    """Why a NetLab (`nat`: one with home routers) cannot be built here, or None if it can."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc", *(["iptables"] if nat else [])):
        if shutil.which(tool) is None:
            return f"{tool} ({'iptables' if tool == 'iptables' else 'iproute2'}) is not installed"
    return None


def raise_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, so that `with NetLab(...)` tears down as on Ctrl-C."""

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


class NetLab:
    """`nodes` namespaces on one bridge, every link shaped to `rate_mbit` each way (None: unshaped);
    `homes`: the nodes that sit behind a home router of their own (see the module docstring)."""

    def __init__(
        self, nodes: int, rate_mbit: float | None, *, latency_ms: float = 100.0, homes: Sequence[int] = ()
    ):
        if not 1 <= nodes <= 100:
            raise ValueError(f"nodes must be in [1, 100], got {nodes}")
        if any(not 0 <= node < nodes for node in homes):
            raise ValueError(f"homes must be nodes in [0, {nodes - 1}], got {list(homes)}")
        self.homes = frozenset(homes)
        self.subnet = PUBLIC_SUBNET if self.homes else SUBNET
        if rate_mbit is not None and not 0.01 <= rate_mbit <= 100_000:
            raise ValueError(f"rate_mbit must be in [0.01, 100000], got {rate_mbit}")
        self.nodes, self.rate_mbit, self.latency_ms = nodes, rate_mbit, latency_ms
        self.prefix = f"shl{os.getpid()}"
        self.bridge = f"{self.prefix}-br"
        self._made: list[str] = []  # namespaces created, removed in reverse
        self._processes: list[subprocess.Popen] = []

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-{node}"

    def address(self, node: int) -> str:
        """The node's address on the bridge (its router's, for a node behind one)."""
        return f"{self.subnet}.{node + 1}"

    def lan_address(self, node: int) -> str:
        """The node's own address: behind its router if it has one, else its bridge address."""
        return f"10.{100 + node}.0.2" if node in self.homes else self.address(node)

    def __enter__(self) -> "NetLab":
        reason = available(nat=bool(self.homes))
        if reason is not None:
            raise NetLabError(reason)
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add_namespace(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for node in range(self.nodes):
            namespace = self.namespace(node)
            inside, outside = f"{self.prefix}v{node}", f"{self.prefix}b{node}"
            if node in self.homes:
                namespace = f"{self.prefix}-r{node}"  # the router is the one on the bridge
            self._add_namespace(namespace)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "netns", self.bridge)
            _ip("-n", namespace, "link", "set", inside, "name", "eth0")
            _ip("-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", self.bridge, "link", "set", outside, "master", "br0", "up")
            if self.rate_mbit is not None:  # upload: the node's side; download: the bridge's side
                self._shape(namespace, "eth0")
                self._shape(self.bridge, outside)
            if node in self.homes:
                self._home(node, router=namespace)

    def _home(self, node: int, router: str) -> None:
        """Node `node`'s namespace on a private network behind `router`, which masquerades it."""
        home, lan = self.namespace(node), f"10.{100 + node}.0"
        self._add_namespace(home)
        inside, outside = f"{self.prefix}h{node}", f"{self.prefix}l{node}"
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", home)
        _ip("link", "set", outside, "netns", router)
        _ip("-n", home, "link", "set", inside, "name", "eth0")
        _ip("-n", home, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _ip("-n", home, "link", "set", "eth0", "up")
        _ip("-n", home, "route", "add", "default", "via", f"{lan}.1")
        _ip("-n", router, "link", "set", outside, "name", "lan0")
        _ip("-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _ip("-n", router, "link", "set", "lan0", "up")
        _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        for rule in (
            ["-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"],
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"],
        ):  # fmt: skip
            _run(["ip", "netns", "exec", router, "iptables", *rule])

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str) -> None:
        assert self.rate_mbit is not None  # shaped only when a rate is set (_build)
        rate_bytes = self.rate_mbit * 1e6 / 8
        # a burst of 10 ms of the rate, at least 64 KiB so that GSO segments pass whole
        burst = max(64 * 1024, int(rate_bytes / 100))
        shape = ["rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", f"{self.latency_ms}ms"]
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", *shape])

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` inside node `node`'s namespace, in a process group of its own (stopped on exit)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(node), *argv], start_new_session=True, **kwargs
        )
        self._processes.append(process)
        return process

    def counters(self, node: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by node `node`'s interface, as the kernel counts them."""
        shown = _run(["ip", "-n", self.namespace(node), "-s", "-j", "link", "show", "eth0"])
        stats = json.loads(shown)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def close(self) -> None:
        for process in self._processes:
            _kill_group(process)
        self._processes.clear()
        for name in reversed(self._made):
            with contextlib.suppress(NetLabError):
                _ip("netns", "del", name)  # takes the veth ends and the bridge with it
        self._made.clear()


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True, check=False)
    try:
        return [entry["name"] for entry in json.loads(listed.stdout or "[]")]
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def remove_stale() -> list[str]:
    """Removes the namespaces of NetLabs whose process is gone; returns their names."""
    removed = []
    for name in namespaces():
        match = NAME.match(name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(NetLabError):
                _ip("netns", "del", name)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: {result.stderr.strip() or f'exit {result.returncode}'}")
    return result.stdout

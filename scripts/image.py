#!/usr/bin/env python3
"""Build and run forewarn's container image without a Docker engine: buildah builds, a read-only root runs.

    scripts/image.py base  [--arch amd64|arm64] [--tag NAME]      a Debian base from Debian's packages
    scripts/image.py build [--base NAME] [--extras all|slim] [--arch ARCH] [--version V] [--tag NAME]
    scripts/image.py run   IMAGE [--state DIR] [--env K=V ...] [--entrypoint PROGRAM] [-- ARGS...]
    scripts/image.py exec  IMAGE --pidfile FILE [-- ARGS...]        beside a running `run --pidfile FILE`
    scripts/image.py healthcheck IMAGE [--pidfile FILE]            the image's HEALTHCHECK command, inside it
    scripts/image.py layers IMAGE                                  what each layer adds, as JSON

Registries of container images are out of reach on the machines the tests run on, so `base` makes the base
the Dockerfile's BASE argument names from Debian's packages with mmdebstrap. `build` runs `buildah build` on
the Dockerfile as it is, with chroot isolation; the build's pip trusts the host's CA bundle, given as a
build secret for the build stage only (nothing of it reaches a layer). `run` does what a container
runtime does for `docker run --read-only --cap-drop ALL --user 65532:65532 -v STATE:/var/lib/forewarn`:
the image's root, bind-mounted read-only in a private mount namespace and a new PID namespace, the state
dir the only writable path, every capability dropped (bounding set included) with no_new_privs, the
image's environment only, and a network namespace of its own with loopback alone (`--network host` shares
the host's). `exec` and `healthcheck` run beside it in its network namespace, as `docker exec` does.
Needs root, buildah, mmdebstrap (base) and util-linux's unshare. docs/container.md explains the choices.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = "/var/lib/forewarn"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What the base holds: python with venv (the Dockerfile's build stage), groupadd/useradd (passwd) and the
#: CA certificates the runtime's TLS needs. Documentation and translations are left out.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "passwd")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


def default_base(arch: str) -> str:
    return f"localhost/forewarn-test-base:bookworm-{arch}"


def host_arch() -> str:
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)


def run(*argv: str, timeout: float = 1800, capture: bool = False) -> str:
    result = subprocess.run(argv, check=True, timeout=timeout, text=True,
                            stdout=subprocess.PIPE if capture else None)
    return result.stdout if capture else ""


# --- base ----------------------------------------------------------------------------------------------

def cmd_base(args: argparse.Namespace) -> int:
    tag = args.tag or default_base(args.arch)
    with tempfile.TemporaryDirectory(prefix="forewarn-base-") as scratch:
        tarball = Path(scratch) / "base.tar"
        run("mmdebstrap", "--variant=minbase", f"--architectures={args.arch}",
            "--include=" + ",".join(BASE_PACKAGES),
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--quiet", args.suite, str(tarball), args.mirror)
        container = run("buildah", "from", "--arch", args.arch, "scratch", capture=True).strip()
        try:
            run("buildah", "add", "--quiet", container, str(tarball), "/")
            run("buildah", "config", "--arch", args.arch, "--os", "linux", "--env", f"PATH={DEFAULT_PATH}",
                "--cmd", "/bin/bash", container)
            run("buildah", "commit", "--quiet", "--rm", container, tag)
        except BaseException:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
            raise
    print(tag)
    return 0


# --- build ---------------------------------------------------------------------------------------------

def host_ca_bundle() -> str | None:
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), *HOST_CA_BUNDLES):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def cmd_build(args: argparse.Namespace) -> int:
    base = args.base or default_base(args.arch)
    tag = args.tag or f"localhost/forewarn:{args.version}{'' if args.extras == 'all' else '-' + args.extras}"
    argv = ["buildah", "build", "--isolation", "chroot", "--format", "docker", "--layers", "--pull-never",
            "--platform", f"linux/{args.arch}", "--file", str(ROOT / "Dockerfile"),
            "--build-arg", f"BASE={base}", "--build-arg", f"EXTRAS={args.extras}",
            "--build-arg", f"VERSION={args.version}", "--tag", tag]
    # The build's pip trusts the host's CA bundle, passed as a build secret with PIP_CERT naming it: both
    # reach the build stage's RUN only, never a layer of the image (a --volume would leave its mount point).
    if args.no_cache:
        argv.append("--no-cache")
    ca = host_ca_bundle()
    if ca:
        argv += ["--secret", f"id=pip-ca,src={ca}", "--build-arg", "PIP_CERT=/run/secrets/pip-ca"]
    run(*argv, str(ROOT), timeout=args.timeout)
    print(tag)
    return 0


# --- inspect -------------------------------------------------------------------------------------------

def inspect(image: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(run("buildah", "inspect", "--type", "image", image, capture=True))
    return info


def image_config(image: str) -> dict[str, Any]:
    """The image's run configuration (Env, Entrypoint, Cmd, User, WorkingDir, Labels, Healthcheck)."""
    info = inspect(image)
    config: dict[str, Any] = dict(info["OCIv1"].get("config") or {})
    docker = (info.get("Docker") or {}).get("config") or {}
    if docker.get("Healthcheck"):
        config["Healthcheck"] = docker["Healthcheck"]
    config["Architecture"] = info["OCIv1"].get("architecture")
    return config


def cmd_layers(args: argparse.Namespace) -> int:
    history = json.loads(run("podman", "history", "--format", "json", args.image, capture=True))
    layers = [{"size": entry["size"], "created_by": entry["CreatedBy"]} for entry in reversed(history)
              if entry["size"]]
    total = json.loads(run("podman", "image", "inspect", args.image, capture=True))[0]["Size"]
    json.dump({"image": args.image, "size": total, "layers": layers}, sys.stdout, indent=1)
    print()
    return 0


# --- run -----------------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    config = image_config(args.image)
    entrypoint = [args.entrypoint] if args.entrypoint else list(config.get("Entrypoint") or [])
    command = args.args if args.args or args.entrypoint else list(config.get("Cmd") or [])
    return run_in_image(args.image, config, entrypoint + command, state=args.state, extra_env=args.env,
                        network=args.network, pidfile=args.pidfile)


def cmd_exec(args: argparse.Namespace) -> int:
    config = image_config(args.image)
    return run_in_image(args.image, config, args.args, extra_env=args.env, join=container_pid(args.pidfile))


def cmd_healthcheck(args: argparse.Namespace) -> int:
    config = image_config(args.image)
    test = (config.get("Healthcheck") or {}).get("Test") or []
    if not test or test[0] != "CMD":
        print(f"{args.image}: no exec-form HEALTHCHECK in the image (build with --format docker)", file=sys.stderr)
        return 2
    return run_in_image(args.image, config, test[1:], join=container_pid(args.pidfile))


def container_pid(pidfile: str | None) -> int | None:
    return int(Path(pidfile).read_text()) if pidfile else None


def run_in_image(image: str, config: dict[str, Any], argv: list[str], *, state: str | None = None,
                 extra_env: list[str] = (), network: str = "private",  # type: ignore[assignment]
                 pidfile: str | None = None, join: int | None = None) -> int:
    """Run argv in a fresh read-only view of the image. network "private": a network namespace of its own
    with only loopback (as a container's); "host": the host's. join: the PID of a container started by
    run, whose network namespace this process shares (`docker exec`, as a HEALTHCHECK runs)."""
    if not argv:
        print("nothing to run: the image has no entry point or command", file=sys.stderr)
        return 2
    container = run("buildah", "from", "--pull-never", "--quiet", image, capture=True).strip()
    try:
        rootfs = run("buildah", "mount", container, capture=True).strip()
        env = [*config.get("Env", []), *extra_env]
        user = str(config.get("User") or "0:0")
        mountpoint = tempfile.mkdtemp(prefix="forewarn-root-")
        private = join is None and network == "private"
        spec = {"root": rootfs, "mountpoint": mountpoint, "argv": argv, "env": env, "user": user,
                "state": state, "workdir": config.get("WorkingDir") or "/", "loopback_up": private}
        namespaces = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child"]
        if private:
            namespaces.append("--net")
        if join is not None:
            namespaces = ["nsenter", f"--target={join}", "--net", "--", *namespaces]
        child = subprocess.Popen([*namespaces, sys.executable, str(Path(__file__).resolve()), "_inner",
                                  json.dumps(spec)])
        if pidfile:
            Path(pidfile).write_text(f"{child.pid}\n")

        def forward(signum: int, _frame: object) -> None:
            """A stop reaches the program in the image (PID 1 of its namespace), as `docker stop` does."""
            for pid in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split():
                os.kill(int(pid), signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            return child.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.rmdir(mountpoint)  # empty again: its mounts lived in the namespace that just ended
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


def loopback_up() -> None:
    """ip link set lo up, without iproute2: a new network namespace starts with loopback down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def inner(spec_json: str) -> None:
    """In the new mount and PID namespaces: lay out the container's root, drop to its user, exec."""
    spec = json.loads(spec_json)
    new_root = spec["mountpoint"]
    if spec["loopback_up"]:
        loopback_up()

    def mount(*argv: str) -> None:
        subprocess.run(["mount", *argv], check=True)

    mount("--bind", spec["root"], new_root)
    mount("-o", "remount,bind,ro", new_root)
    mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", f"{new_root}/proc")
    mount("-t", "tmpfs", "-o", "nosuid,mode=755,size=64k", "tmpfs", f"{new_root}/dev")
    for device in ("null", "zero", "full", "random", "urandom", "tty"):
        Path(f"{new_root}/dev/{device}").touch()
        mount("--bind", f"/dev/{device}", f"{new_root}/dev/{device}")
    os.symlink("/proc/self/fd", f"{new_root}/dev/fd")
    mount("-o", "remount,ro,bind", f"{new_root}/dev")
    if spec["state"]:
        mount("--bind", spec["state"], f"{new_root}{STATE_DIR}")
    uid, _, gid = spec["user"].partition(":")
    os.chroot(new_root)
    os.chdir(spec["workdir"])
    libc = ctypes.CDLL(None, use_errno=True)
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setgroups([])
    os.setgid(int(gid or uid))
    os.setuid(int(uid))  # leaves no permitted, effective or ambient capability (uid 0 -> non-zero)
    env = dict(item.partition("=")[::2] for item in spec["env"])
    program = spec["argv"][0]
    if "/" not in program:
        found = shutil.which(program, path=env.get("PATH", DEFAULT_PATH))
        if found is None:
            sys.stderr.write(f"{program}: not found on the image's PATH\n")
            os._exit(127)
        program = found
    os.execve(program, spec["argv"], env)  # noqa: S606 - the container's program, no shell


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_inner"]:
        inner(argv[1])
        return 1  # not reached: execve replaced this process
    parser = argparse.ArgumentParser(prog="scripts/image.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    base = commands.add_parser("base", help="a Debian base image from Debian's packages (mmdebstrap)")
    base.add_argument("--arch", default=host_arch())
    base.add_argument("--tag")
    base.add_argument("--suite", default="bookworm")
    base.add_argument("--mirror", default=DEBIAN_MIRROR)
    build = commands.add_parser("build", help="buildah build of the Dockerfile, unchanged")
    build.add_argument("--arch", default=host_arch())
    build.add_argument("--base", help="the BASE build argument (default: the base `base` makes)")
    build.add_argument("--extras", default="all")
    build.add_argument("--version", default=None, help="the VERSION label (default: forewarn's version)")
    build.add_argument("--tag")
    build.add_argument("--timeout", type=float, default=3600)
    build.add_argument("--no-cache", action="store_true", help="build every layer anew (for timing)")
    for name in ("run", "exec", "healthcheck", "layers"):
        sub = commands.add_parser(name)
        sub.add_argument("image")
        if name in ("run", "exec"):
            sub.add_argument("--env", action="append", default=[], metavar="K=V")
        if name in ("exec", "healthcheck"):
            sub.add_argument("--pidfile", required=name == "exec",
                             help="the --pidfile of a running `run`: share its network (as docker exec)")
        if name == "run":
            sub.add_argument("--state", help="the host directory mounted writable on " + STATE_DIR)
            sub.add_argument("--entrypoint")
            sub.add_argument("--network", choices=("private", "host"), default="private")
            sub.add_argument("--pidfile", help="write the PID whose namespaces exec and healthcheck join")
    rest: list[str] = []
    if "--" in argv:  # what follows -- goes to the program in the image as it is
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    args.args = rest
    if args.command == "build" and args.version is None:
        sys.path.insert(0, str(ROOT / "src"))
        from forewarn import __version__
        args.version = __version__
    handlers = {"base": cmd_base, "build": cmd_build, "run": cmd_run, "exec": cmd_exec,
                "healthcheck": cmd_healthcheck, "layers": cmd_layers}
    return int(handlers[args.command](args))


if __name__ == "__main__":
    sys.exit(main())

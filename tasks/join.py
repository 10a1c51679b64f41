"""A new host joins the fleet (``homefleet worker join SERVER_URL JOIN_TOKEN``, docs/operations.md,
"Add a machine"), and ``homefleet doctor``'s look at a worker host.

The join: detect this host's device (torch: CUDA, else MPS, else CPU, and its memory), trade the
join token for the machine's grant (``POST /internal/v1/join``: name, own token, broker
settings; the server refuses a device other than the registered one, 409 ``device_mismatch``),
write the machine's token to ``<folder>/worker-token`` (mode 0600, ``folder`` = the parent of
the models folder, the worker's own folder, where its spool also lives) and the worker's settings
to ``<folder>/worker.env`` (0600; no token in it, only its file's path). The join token, single
use and short-lived, is the only secret that may appear on a command line; the machine's token
never does.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from dotenv import dotenv_values

from app.core.config import BrokerSettings, local_server_url, split_server_urls, token_from_file
from app.core.connections import create_redis, redacted_url
from app.core.errors import Conflict, HomefleetError, Unauthorized
from app.core.protocol import JoinGrant, JoinRequest
from app.core.tls import tls_context, untrusted_advice, untrusted_certificate

#: files of the worker's folder, each readable by its owner only
TOKEN_FILE = "worker-token"
ENV_FILE = "worker.env"
FILE_MODE = 0o600


@dataclass(frozen=True)
class DeviceFacts:
    """This host's device as torch sees it. ``memory_bytes``: total memory of the device (RAM for
    ``cpu``), 0 when unknown; ``torch``: torch's version, or None when torch is not installed."""

    backend: str
    memory_bytes: int
    torch: str | None
    name: str = ""


def probe() -> DeviceFacts:
    """Detect the device in this process (imports torch; on CUDA it initialises the driver:
    call :func:`probe_apart` in a process that forks workers afterwards)."""
    try:
        import torch
    except ImportError:
        return DeviceFacts("cpu", _ram_bytes(), None, "torch not installed")
    from tasks.devices import detect_device

    backend = detect_device()
    if backend == "cuda":
        props = torch.cuda.get_device_properties(0)
        return DeviceFacts("cuda", int(props.total_memory), torch.__version__, props.name)
    if backend == "mps":
        return DeviceFacts("mps", int(torch.mps.recommended_max_memory()), torch.__version__, "Apple GPU")
    return DeviceFacts("cpu", _ram_bytes(), torch.__version__, "CPU")


def _ram_bytes() -> int:
    from tasks.devices import CpuDevice

    return CpuDevice().capacity_bytes()


def probe_apart(timeout_s: float = 300.0) -> DeviceFacts:
    """:func:`probe` in a child interpreter, so that this process never initialises CUDA before
    Celery forks its pool (a forked child cannot use a CUDA context its parent made)."""
    code = "import json, dataclasses, tasks.join as j; print(json.dumps(dataclasses.asdict(j.probe())))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise HomefleetError(
            f"detecting this host's device failed: {done.stderr.strip()[-500:]}", reason="device_unknown"
        )
    return DeviceFacts(**json.loads(done.stdout.strip().splitlines()[-1]))


def read_join_token(given: str | None, token_file: Path | None) -> str:
    """The join token: ``given`` (argv), else ``token_file``'s text, else one line of stdin
    (``given`` or ``token_file`` ``-`` also reads stdin, as docs/operations.md shows).

    Raises:
        HomefleetError: reason ``join_token_missing`` when none was given.
    """
    if token_file is not None and str(token_file) != "-":
        token = token_file.expanduser().read_text().strip()
    elif given and given != "-":
        token = given.strip()
    else:
        token = sys.stdin.readline().strip()
    if not token:
        raise HomefleetError(
            "no join token: pass it as JOIN_TOKEN, --join-token-file FILE or on stdin "
            "(`homefleet machines add` on the server prints it)",
            reason="join_token_missing",
        )
    return token


def request_grant(server_url: str, join_token: str, device: DeviceFacts, timeout_s: float = 30.0) -> JoinGrant:
    """Trade ``join_token`` for the machine's grant.

    Raises:
        Unauthorized: the join token is unknown, used or expired (its reason says which).
        Conflict: ``device_mismatch`` (this device is not the registered one) or
            ``machine_not_loaded``.
        HomefleetError: any other refusal; reason ``server_unreachable`` when ``server_url`` is
            no http(s) URL or nothing answers there, ``not_a_homefleet_server`` when what answers
            there is not Homefleet's join route, ``certificate_untrusted`` when its TLS
            certificate is not one this host trusts (``SSL_CERT_FILE`` names the one to trust).
    """
    body = JoinRequest(backend=device.backend, memory_bytes=device.memory_bytes).model_dump()
    try:
        response = httpx.post(
            f"{server_url.rstrip('/')}/internal/v1/join",
            json=body,
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {join_token}"},
            verify=tls_context(),
        )
    except (httpx.HTTPError, httpx.InvalidURL) as unreachable:
        if (untrusted := untrusted_certificate(unreachable)) is not None:
            raise HomefleetError(
                untrusted_advice(server_url, untrusted), reason="certificate_untrusted"
            ) from unreachable
        raise HomefleetError(
            f"the server at {server_url!r} cannot be reached ({type(unreachable).__name__}: {unreachable}); the join "
            "token was not spent: once the server runs and listens there (HOMEFLEET_API_HOST=0.0.0.0 for another "
            "host), run this same command again; else give the URL `homefleet machines add` printed, e.g. "
            "http://server:8787",
            reason="server_unreachable",
        ) from unreachable
    if response.is_success:
        return JoinGrant.model_validate(response.json())
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):  # no JSON, or no JSON object
        error = {}
    message, reason = error.get("message") or response.text[:500], error.get("reason")
    if not_the_join_route(response.status_code, reason):
        said = (
            f"{response.status_code} {reason}"
            if reason
            else f"{response.status_code} {response.headers.get('content-type', '')}"
        )
        raise HomefleetError(
            f"{server_url!r} is not the address of a Homefleet server's API: its join route answered {said.strip()}; "
            "give the URL `homefleet machines add` printed, the server's own address without a path such as /v1 "
            "(e.g. http://server:8787)",
            reason="not_a_homefleet_server",
        )
    for cls in (Unauthorized, Conflict):
        if response.status_code == cls.status_code:
            raise cls(message, reason=reason)
    raise HomefleetError(f"the server answered {response.status_code}: {message}", reason=reason)


def not_the_join_route(status: int, reason: str | None) -> bool:
    """Whether a refused join's answer (its HTTP ``status`` and Homefleet's error ``reason``) came
    from something other than ``POST /internal/v1/join``: no Homefleet error (another web server,
    Flower's port), no such route (404, 405: a path before it, e.g. ``…/v1``), or a 401 that is no
    join token's refusal (a public route's key check)."""
    return reason is None or status in (404, 405) or (status == 401 and not reason.startswith("join_token_"))


def check_device(grant: JoinGrant, device: DeviceFacts) -> None:
    """The server checked it too; a worker never runs on a device it was not registered with.

    Raises:
        Conflict: reason ``device_mismatch``.
    """
    if grant.backend != device.backend:
        raise Conflict(
            f"machine {grant.machine!r} is registered as {grant.backend}, but this host has {device.backend}",
            reason="device_mismatch",
        )


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` created with mode 0600 (never readable by others, not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), FILE_MODE)
        out.write(text)


def save_grant(grant: JoinGrant, server_url: str, models_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Write the machine's token and the worker's settings into its folder (``models_dir``'s
    parent); return the token file and the settings (``WorkerSettings`` fields) to start with."""
    folder = models_dir.expanduser().resolve().parent
    models_dir.mkdir(parents=True, exist_ok=True)
    token_file = folder / TOKEN_FILE
    write_private(token_file, grant.token + "\n")
    settings: dict[str, Any] = {
        **grant.broker,
        "machine": grant.machine,
        "models_dir": str(models_dir.resolve()),
        "worker_token_file": str(token_file),
        "server_url": server_url,
    }
    lines = [f"HOMEFLEET_{key.upper()}={value}" for key, value in settings.items()]
    write_private(
        folder / ENV_FILE,
        "# written by `homefleet worker join`: the worker's settings "
        "(the token is in worker_token_file)\n" + "\n".join(lines) + "\n",
    )
    return token_file, settings


def doctor(values: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``homefleet doctor``: what this host has, as (what, finding) lines, and what is missing.
    ``values``: ``HOMEFLEET_*`` settings (the environment, over a ``worker.env``)."""
    import redis

    lines: list[tuple[str, str]] = []
    missing: list[str] = []
    device = probe()
    if device.torch is None:
        lines.append(("torch", "not installed"))
        missing.append('torch: install the wheel for this host\'s device (docs/operations.md, "Install a worker host")')
    else:
        lines.append(("torch", device.torch))
    lines.append(("device", f"{device.backend} {device.name} ({device.memory_bytes / 1e9:.1f} GB)".replace("  ", " ")))
    try:
        server_urls = split_server_urls(values.get("HOMEFLEET_SERVER_URL") or local_server_url(values))
    except ValueError as error:
        server_urls = []
        lines.append(("server", str(error)))
        missing.append("a server URL (HOMEFLEET_SERVER_URL)")
    answering: list[str] = []
    for server_url in server_urls:
        try:
            status = httpx.get(f"{server_url}/health", timeout=5, verify=tls_context()).status_code
            lines.append(("server", f"{server_url}: answers ({status})"))
            answering.append(server_url)
        except httpx.HTTPError as error:
            if (untrusted := untrusted_certificate(error)) is not None:
                lines.append(("server", f"{server_url}: certificate not trusted ({untrusted.verify_message})"))
                missing.append(untrusted_advice(server_url, untrusted))
                continue
            lines.append(("server", f"{server_url}: unreachable ({type(error).__name__})"))
            missing.append(f"the server at {server_url} (HOMEFLEET_SERVER_URL)")
    redis_url = values.get("HOMEFLEET_REDIS_URL", "redis://127.0.0.1:6379/0")
    # never print a password: the host part, or each Sentinel's address redacted
    shown = redacted_url(redis_url) if ";" in redis_url else redis_url.split("@", 1)[-1]
    try:
        # the server's own client factory: a sentinel:// URL is asked for its master (docs/operations.md)
        create_redis(
            BrokerSettings(redis_url=redis_url, redis_sentinel_master=values.get("HOMEFLEET_REDIS_SENTINEL_MASTER", ""))
        ).ping()
        lines.append(("broker", f"{shown}: answers"))
    except (redis.RedisError, ValueError) as error:
        lines.append(("broker", f"{shown}: unreachable ({type(error).__name__})"))
        missing.append(f"the broker at {shown} (HOMEFLEET_REDIS_URL)")
    token: str | None = values.get("HOMEFLEET_WORKER_TOKEN") or None
    token_file = values.get("HOMEFLEET_WORKER_TOKEN_FILE")
    if token_file:
        token = None
        path = Path(token_file).expanduser()
        try:
            found = path.stat().st_mode
        except OSError:
            lines.append(("token file", f"{path}: absent"))
            missing.append(f"the token file {path} (`homefleet worker join` writes it)")
        else:
            mode = found & 0o777
            regular = stat.S_ISREG(found)
            lines.append(("token file", f"{path} (mode {mode:04o})" if regular else f"{path}: not a file"))
            if regular and mode & 0o077:
                missing.append(f"a token file readable by its owner only: chmod 600 {path}")
            try:  # as the worker reads it (its settings): one token source, a readable file, a token long enough
                token = token_from_file(path, values.get("HOMEFLEET_WORKER_TOKEN"))
            except ValueError as error:
                missing.append(str(error))
    elif values.get("HOMEFLEET_WORKER_TOKEN"):
        lines.append(("token", "in HOMEFLEET_WORKER_TOKEN (a file is better: --token-file)"))
    else:
        lines.append(("token", "none"))
        missing.append(
            "a machine token: `homefleet worker join SERVER_URL JOIN_TOKEN` writes its file; for a worker started "
            "with `--token-file FILE` (the server's own, say), run `homefleet doctor --token-file FILE`"
        )
    if token and answering:
        asked = token_taken(answering[0], token, values.get("HOMEFLEET_MACHINE", ""))
        if asked is not None:
            lines.append(("token", asked[0]))
            if asked[1]:
                missing.append(asked[1])
    models_dir = values.get("HOMEFLEET_MODELS_DIR")
    if models_dir:
        folder = Path(models_dir).expanduser()
        problem = "" if folder.is_dir() else ": not a folder" if folder.exists() else ": absent"
        lines.append(("models folder", f"{models_dir}{problem}"))
        if problem:
            missing.append(f"the models folder {models_dir}" + (" (a file is there)" if folder.exists() else ""))
    return lines, missing


def token_taken(server_url: str, token: str, machine: str) -> tuple[str, str] | None:
    """Whether the server at ``server_url`` takes ``token`` (for ``machine`` when named), asked as
    the worker asks it (``GET /internal/v1/manifest``): (the finding, what is missing or "");
    None when it answered neither yes nor no (not a Homefleet server, or unreachable now)."""
    headers = {"Authorization": f"Bearer {token}"}
    if machine:
        headers["X-Homefleet-Machine"] = machine
    try:
        answer = httpx.get(f"{server_url}/internal/v1/manifest", headers=headers, timeout=10, verify=tls_context())
    except httpx.HTTPError:
        return None
    if answer.status_code == 200:
        return f"taken by {server_url}" + (f" for machine {machine}" if machine else ""), ""
    if answer.status_code in (401, 403):
        try:
            why = str(answer.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            why = answer.text[:200]
        return (
            f"refused by {server_url} ({why})",
            "a token the server takes: the machine's token in the server's fleet file, or, on a host that joined, "
            f"the one the join command `homefleet machines rotate-token {machine or 'MACHINE'}` prints hands over",
        )
    return None


def read_env_file(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of a ``worker.env``, read as the worker's settings read it
    (python-dotenv, which pydantic-settings uses: quotes, ``export`` and comments alike); a key
    without a value is left out. Raises OSError when ``path`` cannot be read."""
    with path.open(encoding="utf-8") as stream:  # dotenv_values of a path that is no file would read nothing
        return {key: value for key, value in dotenv_values(stream=stream).items() if value is not None}

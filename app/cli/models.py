"""``homefleet models …``: the model registry on the server (R1, R4, R5)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from app.cli.common import console, errors, print_table, server_settings
from app.core.errors import Rejected

if TYPE_CHECKING:
    from app.context import ServerContext
    from app.db.tables import ModelRecord

models_cli = typer.Typer(help="The model registry (server side).", no_args_is_help=True)


@models_cli.command("make-tiny")
def models_make_tiny(
    directory: Annotated[Path, typer.Argument(help="where to build the tiny pipelines")],
    family: Annotated[
        list[str] | None,
        typer.Option(
            help="families to build (repeatable): sd1, sdxl, flux, sd1-pix2pix, qwen-image, flux-kontext, sd-upscale, "
            "animatediff, wan, or all; default sd1"
        ),
    ] = None,
    kind: Annotated[
        list[str] | None,
        typer.Option(
            help="or kinds (repeatable): txt2img, edit, upscale, video (their SD-1-based families), or text "
            "(causal LMs: --family llama, qwen2, gpt2; default all three)"
        ),
    ] = None,
    seed: int = 0,
) -> None:
    """Build tiny diffusers pipelines, or tiny causal LMs (``--kind text``), with random weights
    (never downloads anything)."""
    from app.devtools.tiny_models import KIND_FAMILIES, TINY_MODELS, make_tiny_families
    from app.devtools.tiny_text import TEXT_FAMILIES, make_tiny_text

    if "text" in (kind or []):
        families = [name for name in family or [] if name != "all"] or list(TEXT_FAMILIES)
        try:
            texts = make_tiny_text(directory, families=families, seed=seed)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--family") from error
        for name, folder in texts.items():
            console.print(f"{name}: {folder}")
        return
    wanted = list(family or [])
    if "all" in wanted:
        wanted = list(TINY_MODELS.values())
    unknown = [name for name in kind or [] if name not in KIND_FAMILIES]
    if unknown:
        raise typer.BadParameter(
            f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(KIND_FAMILIES)}", param_hint="--kind"
        )
    wanted += [KIND_FAMILIES[name] for name in kind or []]
    try:
        built = make_tiny_families(directory, families=wanted or ["sd1"], seed=seed)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--family") from error
    for name, folder in built.items():
        console.print(f"{name}: {folder}")


@models_cli.command("make-tiny-lora")
def models_make_tiny_lora(
    base: Annotated[Path, typer.Argument(help="the diffusers folder whose UNet it adapts, e.g. DIR/tiny-sd")],
    directory: Annotated[Path, typer.Argument(help="where to save pytorch_lora_weights.safetensors")],
    seed: int = 0,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank")] = 4,
) -> None:
    """Build a tiny random LoRA adapter for a tiny pipeline's UNet (no training, no
    download); register it with ``homefleet models add DIRECTORY --adapter-of FAMILY``."""
    from app.devtools.tiny_models import make_tiny_lora

    folder = make_tiny_lora(base, directory, seed=seed, rank=rank, force=True)
    console.print(f"adapter: {folder}")


@models_cli.command("train-shapes")
def models_train_shapes(
    directory: Annotated[
        Path,
        typer.Argument(
            help="where to save shapes-filled/ and shapes-outlined/ (the committed ones: app/devtools/demo_models)"
        ),
    ],
    seed: int = 19,
    threads: Annotated[
        int,
        typer.Option(
            min=1,
            max=2,
            help="torch CPU threads per process (the two models train in two processes at once; the machine is shared)",
        ),
    ] = 1,
    vae_steps: Annotated[int, typer.Option(min=1, help="VAE steps (batch 16)")] = 1500,
    unet_steps: Annotated[int, typer.Option(min=1, help="steps per model (batch 32)")] = 1500,
    dataset: Annotated[int, typer.Option(min=32, help="pictures per model's data set")] = 6000,
) -> None:
    """Train the two demo txt2img models on flat shapes, on this CPU, seeded."""
    from app.devtools.train_shapes import train_shapes

    report = train_shapes(
        directory,
        seed=seed,
        threads=threads,
        vae_steps=vae_steps,
        unet_steps=unet_steps,
        dataset=dataset,
        log=console.print,
    )
    console.print(f"trained in {report.total_s:.0f} s; {directory / 'training.json'}")


@models_cli.command("train-recolour")
def models_train_recolour(
    directory: Annotated[
        Path,
        typer.Argument(help="the folder holding shapes-filled/ (its VAE is reused); shapes-recolour/ is saved there"),
    ],
    seed: int = 23,
    threads: Annotated[int, typer.Option(min=1, max=2, help="torch CPU threads (the machine is shared)")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="steps (batch 32)")] = 1000,
    dataset: Annotated[int, typer.Option(min=32, help="picture pairs in the data set")] = 4000,
) -> None:
    """Train the demo edit model (shapes-recolour: "make it blue") on this CPU, seeded."""
    from app.devtools.train_recolour import train_recolour

    figures = train_recolour(directory, seed=seed, threads=threads, steps=steps, dataset=dataset, log=console.print)
    console.print(f"trained in {figures['train_s']:.0f} s; {directory / 'training-recolour.json'}")


@models_cli.command("train-colour-lora")
def models_train_colour_lora(
    directory: Annotated[
        Path,
        typer.Argument(help="the folder holding shapes-filled/ (the base model); shapes-blue-lora/ is saved there"),
    ],
    seed: int = 29,
    threads: Annotated[int, typer.Option(min=1, max=2, help="torch CPU threads (the machine is shared)")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="steps (batch 32)")] = 1000,
    dataset: Annotated[int, typer.Option(min=32, help="pictures in the data set")] = 2000,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank")] = 8,
) -> None:
    """Train the demo LoRA adapter (shapes-blue-lora: every shape blue) of shapes-filled on this CPU, seeded."""
    from app.devtools.train_colour_lora import train_colour_lora

    figures = train_colour_lora(
        directory, seed=seed, threads=threads, steps=steps, dataset=dataset, rank=rank, log=console.print
    )
    console.print(f"trained in {figures['train_s']:.0f} s; {directory / 'training-colour-lora.json'}")


@models_cli.command("add")
def models_add(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="a diffusers folder (with model_index.json), a transformers causal-LM folder (config.json), a "
            "single-file checkpoint FILE.safetensors (with --family), or with --adapter-of a LoRA .safetensors "
            "file (kohya or diffusers layout) or folder; omit with --from-hf-cache"
        ),
    ] = None,
    model_id: Annotated[
        str | None, typer.Option("--id", help="model id; minted from the folder name if absent")
    ] = None,
    precision: Annotated[str, typer.Option(help="fp32 | bf16 | fp16: dtype workers load it with")] = "fp32",
    quantization: Annotated[
        str | None, typer.Option(help="load-time quantization of the denoiser, e.g. torchao-int8wo")
    ] = None,
    adapter_of: Annotated[
        str | None,
        typer.Option(
            "--adapter-of",
            help="PATH is a LoRA adapter of this base family, e.g. sd1 (a .safetensors file as "
            "downloaded, kohya or diffusers layout, or a folder holding "
            "pytorch_lora_weights.safetensors); jobs name it in params.adapters",
        ),
    ] = None,
    from_hf_cache: Annotated[
        str | None,
        typer.Option(
            "--from-hf-cache",
            help="register REPO_ID (e.g. runwayml/stable-diffusion-v1-5) from the local Hugging Face "
            "cache (HF_HUB_CACHE / HF_HOME), no network",
        ),
    ] = None,
    revision: Annotated[
        str | None,
        typer.Option(help="with --from-hf-cache: the branch, tag or commit of the cached snapshot (default main)"),
    ] = None,
    family: Annotated[
        str | None,
        typer.Option(
            help="PATH is a single-file checkpoint (A1111/ComfyUI/Civitai layout) of this family: sd1 | sdxl | flux; "
            "converted once, here, into a diffusers folder"
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="with --family: a diffusers folder of that family whose configs, tokenizers and (flux) other "
            "components the conversion uses instead of the shipped ones"
        ),
    ] = None,
    default: Annotated[
        list[str] | None,
        typer.Option(
            "--default",
            help="NAME=VALUE (repeatable): the model's own default for a job param, applied when a job "
            "does not set it, e.g. guidance_scale=4; VALUE is JSON where it parses (4, 4.5, true), "
            "else text; checked against the kinds it runs",
        ),
    ] = None,
) -> None:
    """Register a model: a diffusers folder, a cached Hugging Face snapshot (--from-hf-cache), a
    single-file checkpoint (--family, converted once into a diffusers folder) or a LoRA adapter
    file or folder (--adapter-of). Mint its id, copy the files its pipeline loads at --precision
    to the server's model folder and hash them; print what is taken and what is left out, and why
    (docs/operations.md, "What registration takes"). A LoRA file whose keys are for another family
    than --adapter-of, or that holds no LoRA, is refused naming the keys."""
    from app.context import build_checked_context
    from app.store.registry import describe_pipeline
    from app.store.selection import HF_CACHE, cached_snapshot, check_exists, select_files, snapshot_repo
    from routing.estimate import readable_bytes

    if (path is None) == (from_hf_cache is None):
        raise typer.BadParameter("give a folder PATH or --from-hf-cache REPO_ID (one of them)", param_hint="PATH")
    if revision is not None and from_hf_cache is None:
        raise typer.BadParameter("--revision applies to --from-hf-cache only", param_hint="--revision")
    if config is not None and family is None:
        raise typer.BadParameter(
            "--config applies to a single-file checkpoint: give its --family too", param_hint="--config"
        )
    if family is not None and (path is None or path.is_dir() or adapter_of is not None):
        from app.store.registry import checkpoint_hint

        what = "a folder" if path is None or path.is_dir() else "an adapter"
        model_folder = path is not None and ((path / "model_index.json").is_file() or (path / "config.json").is_file())
        hint = checkpoint_hint(path, family) if path is not None and path.is_dir() and not model_folder else ""
        raise typer.BadParameter(
            f"--family registers a single-file checkpoint (one .safetensors file); "
            f"{path or from_hf_cache} is {what}"
            + (hint.replace(". It holds", "; it holds", 1) if hint else ": register it without --family"),
            param_hint="--family",
        )
    if path is not None and family is None and adapter_of is None and path.is_file():
        raise typer.BadParameter(
            f"{path} is a file: a single-file checkpoint needs --family sd1|sdxl|flux (its "
            "key layout is checked against it), a LoRA file --adapter-of FAMILY",
            param_hint="--family",
        )
    defaults = parse_defaults(default or [])
    ctx = build_checked_context(server_settings())
    selection = None
    try:
        if family is not None:
            assert path is not None  # checked above
            from app.store.single_file import check_checkpoint

            check_checkpoint(path.resolve(), family)  # refused before anything is said to be converting
            console.print(f"converting {path.name} ({family}) into a diffusers folder …")
            record = ctx.registry.add_single_file(
                path, family, model_id, precision=precision, quantization=quantization, config=config, defaults=defaults
            )
        else:
            extra: dict[str, str] = {}
            if from_hf_cache is not None:
                path = cached_snapshot(from_hf_cache, revision)
                extra = {"mint_from": from_hf_cache.rsplit("/", 1)[-1], **_cache_source(from_hf_cache, path)}
                console.print(f"{from_hf_cache}: snapshot {path}")
                _warn_interrupted(from_hf_cache, path)
            elif path is not None and path.is_dir() and (repo := snapshot_repo(path.absolute())) is not None:
                # a snapshot's own path, as people paste it: named as --from-hf-cache names it, not by its commit
                extra = {"mint_from": repo.rsplit("/", 1)[-1], **_cache_source(repo, path.absolute())}
                console.print(f"{repo}: snapshot {path} (a Hugging Face cache snapshot)")
                _warn_interrupted(repo, path.absolute())
            assert path is not None  # checked above
            if not path.is_file():  # what add() takes, for the lines below (a LoRA file is taken whole)
                check_exists(path)
                if adapter_of is None:  # no model folder at all is refused as such, before its files are read
                    try:
                        describe_pipeline(path.resolve())
                    except Rejected as error:  # a command it suggests keeps this one's options
                        options = [
                            ("--precision", precision if precision != "fp32" else None),
                            ("--quantization", quantization),
                            ("--id", model_id),
                        ]
                        raise Rejected(
                            with_options(error.message, [f"{name} {value}" for name, value in options if value]),
                            reason=error.reason,
                        ) from error
                selection = select_files(path.resolve(), precision, adapter=adapter_of is not None)
                if extra.get("source_format") == HF_CACHE:
                    _warn_unlinked(path, selection.taken)
            record = ctx.registry.add(
                path,
                model_id,
                precision=precision,
                quantization=quantization,
                adapter_of=adapter_of,
                defaults=defaults,
                **extra,
            )
        manifest = ctx.registry.manifest(record.id)
        where = verified_on_server(ctx, record)
    finally:
        ctx.close()
    if selection is not None:
        for name, size in selection.taken.items():
            console.print(f"taken     {readable_bytes(size):>10}  {escape(name)}")
        folded: dict[str, tuple[int, int, str]] = {}  # a component's subfolder -> (files, bytes, why): one line
        for name, (size, why) in selection.left_out.items():
            if why.startswith("in a subfolder of"):
                top = "/".join(name.split("/")[:2]) + "/"
                files, total, _ = folded.get(top, (0, 0, why))
                folded[top] = (files + 1, total + size, why)
                continue
            console.print(f"left out  {readable_bytes(size):>10}  {escape(name)}  ({escape(why)})")
        for top, (files, total, why) in folded.items():
            console.print(f"left out  {readable_bytes(total):>10}  {escape(top)}  ({files} files; {escape(why)})")
        console.print(
            f"taken: {len(selection.taken)} files, {readable_bytes(selection.taken_bytes)}; left out: "
            f"{len(selection.left_out)} files, {readable_bytes(selection.left_out_bytes)}"
        )
    digest = f" {record.source_digest}" if record.source_digest else ""
    console.print(
        f"registered [bold]{record.id}[/] family={record.family} kinds={','.join(record.kinds)} "
        f"files={len(manifest.files)} bytes={record.total_bytes} variant={record.variant.key()} "
        f"weights={readable_bytes(record.weights_bytes or 0)} source={source_text(record)}{digest}"
        + (f" defaults={json.dumps(record.defaults, separators=(',', ':'))}" if record.defaults else "")
    )
    if where:
        console.print(where, soft_wrap=True, highlight=False)


SERVER_VERIFY_WAIT_S = 20.0
"""How long ``models add`` waits for the ``server`` machine to verify a new model (seconds): its
worker reads the registry's folder and verifies a change within a beat or two, plus hashing."""


def verified_on_server(ctx: ServerContext, record: ModelRecord) -> str:
    """Wait (up to :data:`SERVER_VERIFY_WAIT_S`, with a spinner) until the ``server`` machine,
    whose worker reads the registry's folder, has verified ``record`` (R4), so a job submitted
    next is not refused ``model_not_verified``; the line that says where it runs and what other
    machines need (a sync). "" when the fleet has no online ``server`` machine of its family."""
    import time

    from routing.placement import SERVER

    view = ctx.machines.view(SERVER) if SERVER in ctx.fleet.machines else None
    if view is None or not view.online or record.family not in view.families:
        return ""
    others = "; other machines get it with `homefleet sync MACHINE " + record.id + "`"
    deadline = time.monotonic() + SERVER_VERIFY_WAIT_S
    with console.status(f"machine {SERVER} is verifying {record.id} …"):
        while record.id not in view.verified_models:
            if time.monotonic() > deadline or not view.online:
                return (
                    f"machine {SERVER} has not verified {record.id} yet (its worker verifies the registry's "
                    f"changes at each beat; a large model takes a while to hash): `homefleet status` shows when"
                    f"{others}"
                )
            time.sleep(0.25)
            view = ctx.machines.view(SERVER)
    return f"verified on machine {SERVER}: jobs can run it there now{others}"


def with_options(message: str, options: list[str]) -> str:
    """``message`` with ``options`` (``--precision fp16``…) added to each ``homefleet models add
    --from-hf-cache REPO`` command it suggests in backquotes: run as written, it registers what
    the user asked for (without ``--precision fp16`` an fp16-only cache has no loadable weights)."""
    if not options:
        return message
    return re.sub(
        r"(`homefleet models add --from-hf-cache [^`\s]+)`", lambda m: f"{m[1]} {' '.join(options)}`", message
    )


def parse_defaults(pairs: list[str]) -> dict[str, object]:
    """``--default NAME=VALUE`` options as ``{name: value}``; VALUE parsed as JSON where it is
    (``4`` -> 4), else kept as text. Raises typer.BadParameter for a pair without ``=``."""
    defaults: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise typer.BadParameter(f"expected NAME=VALUE, got {pair!r}", param_hint="--default")
        try:
            defaults[name.strip()] = json.loads(value)
        except ValueError:
            defaults[name.strip()] = value
    return defaults


def _cache_source(repo: str, snapshot: Path) -> dict[str, str]:
    """What a model registered from the Hugging Face cache snapshot ``snapshot`` of ``repo``
    records of its source: the format, the repository and the snapshot's commit (its folder's name)."""
    from app.store.selection import HF_CACHE

    return {"source_format": HF_CACHE, "source_repo": repo, "source_revision": snapshot.name}


def _warn_interrupted(repo: str, snapshot: Path) -> None:
    """Say on stderr when the cached repository holds partial downloads: a file of the snapshot
    may be missing, and registration then takes what is there (a ``.bin`` for safetensors)."""
    from app.store.hf_cache import interrupted_downloads

    partial = interrupted_downloads(snapshot)
    if partial:
        names = ", ".join(p.name for p in partial[:3]) + (" …" if len(partial) > 3 else "")
        errors.print(
            f"warning: the cache of {repo} holds {len(partial)} interrupted download(s) ({names}): a file of this "
            f"snapshot may be missing, and what is registered is what the snapshot holds; finish the download "
            f"(`hf download {repo}`) and register again if a file below is not the one you expect",
            soft_wrap=True,
            highlight=False,
        )


def _warn_unlinked(snapshot: Path, taken: Iterable[str]) -> None:
    """Say on stderr which taken files of a cache snapshot are no links into its blobs (a file
    edited in place, or copied over its link): they are registered as they are, with no blob
    name to check them against (``app.store.hf_cache.check_blob``)."""
    plain = sorted(p for p in taken if not (snapshot / p).is_symlink())
    if plain:
        names = ", ".join(plain[:3]) + (" …" if len(plain) > 3 else "")
        errors.print(
            f"warning: {len(plain)} file(s) of this snapshot are no links into the cache's blobs ({names}): "
            "changed in place after the download? they are registered as they are, unchecked against the "
            "hashes the Hub gave them",
            soft_wrap=True,
            highlight=False,
        )


def source_text(record: ModelRecord) -> str:
    """A model's source for people: its format, and for a cache snapshot ``org/name@<commit's
    first 12 hex digits>``."""
    text = record.source_format or ""
    if record.source_repo:
        text += f" {record.source_repo}@{(record.source_revision or '?')[:12]}"
    return text


@models_cli.command("list")
def models_list(
    show_all: Annotated[
        bool, typer.Option("--all", help="the retired models too (`homefleet models retire`), marked retired")
    ] = False,
) -> None:
    """Registered models in service with their family, kinds, precision (and quantization), size
    on disk (the files taken), the weights' size loaded at that precision (what placement prices,
    R10), source (diffusers, hf-cache, single-file, a LoRA's layout…) and pipeline; with --all
    the retired ones too, with the date they were retired."""
    from app.context import build_checked_context
    from routing.estimate import readable_bytes

    ctx = build_checked_context(server_settings())
    try:
        table = Table(
            Column("id", no_wrap=True),  # ids are what people copy: never folded
            "family",
            Column("kinds", overflow="fold"),
            "precision",
            "on disk / loaded",
            Column("source", overflow="fold"),
            Column("pipeline", overflow="fold"),
            *(["retired (UTC)"] if show_all else []),
        )
        for m in ctx.registry.list(retired=show_all):
            retired = [f"{m.retired_at:%Y-%m-%d %H:%M}" if m.retired_at else ""] if show_all else []
            table.add_row(
                m.id,
                m.family,
                ", ".join(m.kinds),
                m.variant.key(),  # two registrations of one download differ here (fp16, fp32+torchao-int8wo)
                f"{readable_bytes(m.total_bytes)} / "
                + (readable_bytes(m.weights_bytes) if m.weights_bytes is not None else "-"),
                source_text(m),
                m.pipeline_class,
                *retired,
            )
        print_table(table)
    finally:
        ctx.close()


@models_cli.command("retire")
def models_retire(
    model: Annotated[str, typer.Argument(help="the id of the model (or adapter) to take out of service")],
    delete_files: Annotated[
        bool, typer.Option("--delete-files", help="also remove the server's copy of its files")
    ] = False,
) -> None:
    """Take a model out of service for good: it is no longer listed (GET /v1/models, `models
    list`), no route defaults to it, a submission naming it is refused (404 model_retired), and
    every worker withdraws it and drops it from memory. Its record stays: its jobs stay readable and its id stays taken.
    Refused (exit 2, model_in_use) while a job of it is queued or running: cancel them or wait.
    --delete-files also removes its files from the server's model folder; without it they stay
    there (the path is printed)."""
    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        with ctx.lock.held("retire it again"):  # submissions journal under it: none slips in (R14, R19)
            done = ctx.registry.retire(model, delete_files=delete_files)
            released = ctx.residency.release_model(model)  # a commitment to it keeps nothing warm (R16, R17)
    finally:
        ctx.close()
    when = f"{done.retired_at:%Y-%m-%d %H:%M} UTC"
    if done.already:
        unchanged = "" if done.files_deleted else "; nothing changed"
        console.print(f"{model} was already retired on {when}{unchanged}", soft_wrap=True, highlight=False)
    else:
        console.print(
            f"retired [bold]{escape(model)}[/] on {when}: no longer listed or submitted to; workers withdraw it "
            "and drop it from memory; its jobs stay in the journal and its id stays taken",
            soft_wrap=True,
        )
    if released:
        console.print(f"released its residency commitment on: {', '.join(released)}", soft_wrap=True, highlight=False)
    if done.files_deleted:
        console.print(f"deleted its files: {done.folder}", soft_wrap=True, highlight=False)
    elif done.folder.exists():
        console.print(
            f"its files stay in {done.folder} (remove them with `homefleet models retire {model} --delete-files`)",
            soft_wrap=True,
            highlight=False,
        )


@models_cli.command("verify")
def models_verify(
    model: Annotated[list[str] | None, typer.Argument(help="model ids; default: every registered model")] = None,
) -> None:
    """Rehash every file of the server's models in full, ignoring the (size, mtime, inode)
    cache, against the REGISTERED digests; record nothing. Exit 1 naming each changed or
    missing file (model, path, registered digest, actual digest) (R5, C07). A retired model
    (named explicitly; the default leaves it out) is checked and marked, but its files fail
    nothing: it runs no job."""
    from app.context import build_checked_context

    ctx = build_checked_context(server_settings())
    try:
        checks = ctx.registry.verify(model or None)
        retired = {m for m in dict.fromkeys(c.model_id for c in checks) if ctx.registry.retired_at(m) is not None}
        deleted = {m for m in retired if not ctx.registry.folder(m).exists()}
    finally:
        ctx.close()
    table = Table("model", "files", "ok", "changed", "missing")  # one row a model; the bad files are listed below
    for model_id in dict.fromkeys(c.model_id for c in checks):
        counts = {
            status: sum(1 for c in checks if c.model_id == model_id and c.status == status)
            for status in ("ok", "changed", "missing")
        }
        table.add_row(
            f"{model_id} (retired)" if model_id in retired else model_id,
            str(sum(counts.values())),
            f"[green]{counts['ok']}[/]",
            f"[yellow]{counts['changed']}[/]" if counts["changed"] else "0",
            f"[red]{counts['missing']}[/]" if counts["missing"] else "0",
        )
    print_table(table)
    bad = [c for c in checks if c.status != "ok"]
    console.print(f"{len(checks)} files rehashed, {len(bad)} changed or missing")
    for check in (c for c in bad if c.model_id not in deleted):  # one line per file, whatever the terminal's width
        console.print(
            f"{check.status}: {check.model_id} {check.path} registered {check.recorded} "
            f"actual {check.actual or 'missing'}",
            soft_wrap=True,
            highlight=False,
        )
    in_service = [m for m in dict.fromkeys(c.model_id for c in bad) if m not in retired]
    if in_service:
        console.print(
            "refused until restored, or taken as new content with `homefleet models update ID` "
            f"({' '.join(in_service)})",
            soft_wrap=True,
            highlight=False,
        )
    for model_id in dict.fromkeys(c.model_id for c in bad if c.model_id in retired):
        console.print(
            f"{model_id} is retired and its files were deleted (`models retire --delete-files`); nothing to restore"
            if model_id in deleted
            else f"{model_id} is retired: it runs no job, so its files serve nothing; remove them with "
            f"`homefleet models retire {model_id} --delete-files`",
            soft_wrap=True,
            highlight=False,
        )
    raise typer.Exit(1 if in_service else 0)  # a retired model's files are kept for its owner, not checked for jobs


@models_cli.command("update")
def models_update(
    model: Annotated[str, typer.Argument(help="the model id whose server folder holds the new content")],
) -> None:
    """Take the current content of the model's server folder as its new manifest (R5): the
    files registration would take from it (the rest is named and left out), checked as
    registration checks them; rehash them, record the new digests and sizes (and its weight
    bytes, re-priced), and tell every worker, which re-verifies its copy and withdraws an old one.
    Then start a sync of the model to each machine that advertised it (the sync sets a
    superseded file aside, R6); a machine that cannot take it now (busy, offline, already
    syncing) is named with the command to run. A folder where no file changed, was added or
    was removed records nothing, withdraws nothing and starts no sync: one line says so
    (docs/operations.md, "Models and integrity")."""
    from app.context import build_checked_context
    from app.core.errors import HomefleetError
    from routing.placement import SERVER

    ctx = build_checked_context(server_settings())
    try:
        had = sorted(m for m in ctx.fleet.machines if ctx.redis.sismember(ctx.keys.verified(m), model))
        changes = ctx.registry.update(model)
        if changes.unchanged:  # the same manifest: no copy is old, so no machine loses the model to a sync
            console.print(
                f"{model}: no file changed; nothing to do (nothing recorded or withdrawn, no sync started)",
                soft_wrap=True,
                highlight=False,
            )
            return
        after = ctx.registry.registered_manifest(model)
        console.print(
            f"updated [bold]{model}[/]: {len(changes.changed)} changed, {len(changes.added)} added, "
            f"{len(changes.removed)} removed; files={len(after.files)} "
            f"bytes={sum(f.size for f in after.files)}"
        )
        for label, paths in (("changed", changes.changed), ("added", changes.added), ("removed", changes.removed)):
            for path in paths:
                console.print(f"  {label}: {path}", soft_wrap=True, highlight=False)
        if changes.left_out:  # as `models add` leaves them out: not recorded, never synced
            console.print(
                f"  left out ({len(changes.left_out)}, no loader reads them; not recorded or synced): "
                + ", ".join(changes.left_out[:10])
                + (" …" if len(changes.left_out) > 10 else ""),
                soft_wrap=True,
                highlight=False,
            )
        workers = [m for m in had if m != SERVER]  # the server's worker reads the server's folder itself
        if SERVER in ctx.fleet.machines:  # advertised or withdrawn there: its worker hashes it again
            console.print(f"{SERVER} reads this folder itself: its worker verifies the new content", highlight=False)
        if not workers:
            console.print(
                f"no other machine advertised it; sync it where it should run: `homefleet sync MACHINE {model}`",
                soft_wrap=True,
                highlight=False,
            )
        for machine in workers:
            try:
                record = ctx.syncs().start(machine, [model])
            except HomefleetError as refusal:
                console.print(
                    f"{machine} held the old content (withdrawn there now); its sync was not started "
                    f"({refusal.reason}: {refusal.message}); run `homefleet sync {machine} {model}` "
                    "later",
                    soft_wrap=True,
                    highlight=False,
                )
                continue
            console.print(
                f"{machine} held the old content (withdrawn there now): sync {record['id']} started "
                f"(`homefleet status` shows it; `homefleet sync {machine} {model}` runs it again)",
                soft_wrap=True,
                highlight=False,
            )
    finally:
        ctx.close()

"""A retrain workspace: a git repository that is also a DVC project holding the pipeline files.

The only module that drives git and DVC (through their command lines, the stable interface);
stage code calls these helpers and never imports DVC itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import yaml

from retrain import codeversions
from retrain.config import MOVED, Params
from retrain.errors import ExternalToolError, WorkspaceError
from retrain.paths import Paths

log = logging.getLogger(__name__)

#: The embedded default DVC remote: a folder outside any workspace.
DEFAULT_REMOTE = "~/.cache/retrain/dvc-remote"
#: The name of a workspace's default DVC remote (a folder, or ``s3://bucket/prefix`` with ``dvc[s3]``).
REMOTE = "store"

#: Files copied from ``retrain/templates`` into a new workspace: template name -> workspace path.
TEMPLATE_FILES = {
    "dvc.yaml": "dvc.yaml",
    "params.yaml": "params.yaml",
    "prefect.yaml": "prefect.yaml",
    "gitignore": ".gitignore",
    "dvcignore": ".dvcignore",
    "data.gitignore": "data/.gitignore",
}

_GIT_IDENTITY = ["-c", "user.name=retrain", "-c", "user.email=retrain@localhost"]


def run_tool(args: list[str], cwd: Path, what: str) -> str:
    """Run a command line tool; raise ``ExternalToolError`` with its last line when it fails.

    Args:
        args: The command and its arguments.
        cwd: Working directory.
        what: What we were doing, for the message.

    Returns:
        The tool's standard output.
    """
    try:
        # DVC_NO_ANALYTICS: nothing leaves this machine. This interpreter's bin folder goes first on PATH so
        # that the `retrain` commands in dvc.yaml run from the same environment, activated or not.
        bindir = os.path.dirname(sys.executable)
        env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False, env=env)
    except OSError as e:
        raise ExternalToolError(f"{what}: cannot run {args[0]} ({e})") from e
    if proc.returncode != 0:
        raise ExternalToolError(f"{what}: {' '.join(args[:3])} failed: {tool_error(proc.stderr + proc.stdout)}")
    return proc.stdout


def tool_error(output: str) -> str:
    """The line of a failed tool's output that says why: DVC's ``ERROR:`` line (its last line is a support footer),
    else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.startswith("Having any troubles?")]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    return errors[0] if errors else lines[-1] if lines else "no output"


def dvc(args: list[str], cwd: Path, what: str) -> str:
    """Run ``dvc`` from this interpreter's environment."""
    return run_tool([sys.executable, "-m", "dvc", *args], cwd, what)


def git(args: list[str], cwd: Path, what: str) -> str:
    """Run ``git`` with a fallback identity (used only where none is configured)."""
    return run_tool(["git", *_GIT_IDENTITY, *args], cwd, what)


def require_workspace(paths: Paths) -> None:
    """Raise ``WorkspaceError`` unless ``paths.root`` is a retrain workspace."""
    missing = [n for n in ("dvc.yaml", "params.yaml", ".dvc") if not (paths.root / n).exists()]
    if missing:
        raise WorkspaceError(
            f"{paths.root} is not a retrain workspace (missing {', '.join(missing)}); "
            "run 'retrain init DIR' or use -C to point at one"
        )


def template_text(name: str) -> str:
    """Text of a packaged template file."""
    return resources.files("retrain").joinpath("templates", name).read_text(encoding="utf-8")


def init_workspace(target: Path, remote: str = DEFAULT_REMOTE) -> Paths:
    """Make a new workspace: pipeline files, ``data/incoming``, ``git init``, ``dvc init``, local remote.

    Args:
        target: A folder that does not exist or is empty.
        remote: URL or path of the default DVC remote.

    Returns:
        The new workspace's paths.

    Raises:
        WorkspaceError: ``target`` exists and is not empty.
    """
    if target.exists() and any(target.iterdir()):
        raise WorkspaceError(f"{target}: exists and is not empty; choose a new folder")
    if shutil.which("git") is None:
        raise WorkspaceError("git is not installed; retrain versions its workspace with git and DVC")
    target.mkdir(parents=True, exist_ok=True)
    paths = Paths.at(target)
    try:
        for src, dst in TEMPLATE_FILES.items():
            out = paths.root / dst
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(template_text(src), encoding="utf-8")
        for d in (paths.incoming, paths.batches):
            d.mkdir(parents=True, exist_ok=True)
            (d / ".gitkeep").touch()
        codeversions.record(paths)
        git(["init", "-q", "-b", "main"], paths.root, "git init")
        dvc(["init", "-q"], paths.root, "dvc init")
        dvc(["config", "core.autostage", "true"], paths.root, "dvc config")
        dvc(["remote", "add", "-d", REMOTE, remote], paths.root, "dvc remote add")
        # A pull re-hashes what it fetched: an object damaged or cut short in the remote is refused, not checked out.
        dvc(["remote", "modify", REMOTE, "verify", "true"], paths.root, "dvc remote modify")
        git(["add", "-A"], paths.root, "git add")
        git(["commit", "-q", "-m", "retrain workspace"], paths.root, "git commit")
    except Exception:
        shutil.rmtree(paths.root, ignore_errors=True)
        raise
    log.info("workspace ready at %s (DVC remote %s)", paths.root, remote)
    return paths



#: Files every run owns besides the stages' outputs: the pipeline, what DVC recorded of it, and its params.
_PIPELINE_FILES = ("dvc.yaml", "dvc.lock", "params.yaml", codeversions.FILE, "data/batches/.gitignore")


def run_files(paths: Paths) -> list[str]:
    """The files a run owns, relative to the root: what ``commit`` stages, and nothing else.

    The pipeline files, each admitted batch's ``.dvc`` file, and for every output ``dvc.yaml`` declares (outs,
    metrics, plots): the output itself when git keeps it (``cache: false``), else the ``.gitignore`` DVC keeps
    beside it.  A file the user left in the workspace is not among them.
    """
    doc = yaml.safe_load(paths.dvc_yaml.read_text(encoding="utf-8")) or {}
    files = set(_PIPELINE_FILES)
    files.update(p.relative_to(paths.root).as_posix() for p in paths.batches.glob("*.dvc"))
    for stage in (doc.get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind) or []:
                path, opts = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
                if isinstance(opts, dict) and opts.get("cache") is False:
                    files.add(Path(path).as_posix())
                else:
                    parent = Path(path).parent
                    files.add((parent / ".gitignore").as_posix())
    return sorted(files)


def commit(paths: Paths, message: str) -> bool:
    """Commit the files the run owns (``run_files``), only those; False when none of them changed.

    Whatever else is in the workspace (a stray export, a credentials file) stays out of the commit, staged or not.
    """
    specs = run_files(paths)
    tracked = git(["ls-files", "-z", "--", *specs], paths.root, "git ls-files").split("\0")
    chosen = sorted({f for f in tracked if f} | {f for f in specs if (paths.root / f).exists()})
    if not chosen:
        return False
    git(["add", "-A", "--", *chosen], paths.root, "git add")
    if not git(["diff", "--cached", "--name-only", "--", *chosen], paths.root, "git diff").strip():
        return False
    git(["commit", "-q", "-m", message, "--", *chosen], paths.root, "git commit")
    return True


def set_params(paths: Paths, values: dict[str, object]) -> None:
    """Set ``section.key`` values in ``params.yaml``, keeping its comments and layout (DVC's own YAML editor, the
    one ``dvc exp run --set-param`` uses)."""
    from dvc.utils.serialize import modify_yaml  # DVC's Python API: seconds to import, only here

    with modify_yaml(paths.params) as doc:
        for dotted, value in values.items():
            *sections, key = dotted.split(".")
            node = doc
            for section in sections:
                node = node[section]
            node[key] = value


#: sha256 of every dvc.yaml an earlier retrain init wrote: ``upgrade`` replaces only those, never a user's own.
_OLD_DVC_YAML = frozenset({
    "865a1f54505233acf737d9cb4cb5a18440f1850bb7e15f168658ae5da0fc3e80",
    "ccb0d4879951a02c87e7ffd117855f33b34c906691a2dab97a6b92c19ac3f197",
    "becb7aa67473fee02838e054bdb5bab93b4c99216d05bdf2f68f74aa3cce5740",
    "d22ddfb695ce00208920aea612dd4fded19248a23a22d0807517dbeb79eecc52",
    "08c98b7b87ccc54bb49d5853112f2deb041556e34a7c0a1c0beb4a1ebf6ba3cd",
    "a45aaa2e14b2e663ecb6bd3b2f406b5dc1ffa040473e1e47ec1baf09916c487c",
    "506b4c889a9bada6287335d5943dab77ee9ea380bbb6fac8c836ec7f252e8510",
    "45ce2419e1c254fa1c41e8bde49c32fe3f214347ef70dc075673b76b50842f64",
    "0fe4f8202cfd4acb384c0c3cc1acb84f683c8f1a5661436f46295e3cbcedac65",
})


def upgrade(paths: Paths) -> list[str]:
    """Bring a workspace made by an earlier retrain to this one's pipeline files; what was done, a line each.

    Moves the params that change speed, not results, to ``runtime`` (``config.MOVED``), replaces a ``dvc.yaml``
    that an earlier ``retrain init`` wrote with this version's (params listed key by key, the code versions), and
    records the code versions.  A ``dvc.yaml`` edited by hand is left alone, with what to change.  Nothing is
    committed: review with ``git diff``, then commit.
    """
    from dvc.utils.serialize import modify_yaml  # DVC's Python API: seconds to import, only here

    done: list[str] = []
    with modify_yaml(paths.params) as doc:
        for (section, key), (new_section, new_key) in MOVED.items():
            if isinstance(doc.get(section), dict) and key in doc[section]:
                value = doc[section].pop(key)
                doc.setdefault(new_section, {})
                if new_key not in doc[new_section]:
                    doc[new_section][new_key] = value
                done.append(f"params.yaml: {section}.{key} -> {new_section}.{new_key}")
        # A key this version's dvc.yaml lists must be in params.yaml (DVC refuses a missing one): a section or key
        # new in this version is added with its default, which is what retrain used for it anyway.
        for section, values in Params().model_dump(mode="json", by_alias=True).items():
            if not isinstance(values, dict) or not isinstance(doc.get(section, {}), dict):
                continue
            have = doc.setdefault(section, {})
            for key, value in values.items():
                if key not in have:
                    have[key] = value
                    done.append(f"params.yaml: {section}.{key} added ({value!r}, the default)")
    current = template_text("dvc.yaml")
    text = paths.dvc_yaml.read_text(encoding="utf-8")
    if text != current:
        if hashlib.sha256(text.encode()).hexdigest() in _OLD_DVC_YAML:
            paths.dvc_yaml.write_text(current, encoding="utf-8")
            done.append("dvc.yaml: replaced by this version's (params key by key, code-versions.yaml)")
        else:
            done.append("dvc.yaml was edited by hand: left alone; list each stage's params key by key and its "
                        f"code-versions.yaml entry as in {Path(__file__).parent / 'templates' / 'dvc.yaml'}")
    if codeversions.record(paths):
        done.append(f"{codeversions.FILE}: recorded")
    ignore = paths.root / ".gitignore"
    have = ignore.read_text(encoding="utf-8").splitlines() if ignore.is_file() else []
    missing = [ln for ln in template_text("gitignore").splitlines() if ln and ln not in have]
    if missing:  # files a newer retrain writes that git must not see (e.g. the history plot)
        ignore.write_text("\n".join([*have, *missing]) + "\n", encoding="utf-8")
        done.append(f".gitignore: {', '.join(missing)} added")
    master = paths.master / "annotations.json"
    if master.is_file() and "split" not in json.loads(master.read_text(encoding="utf-8")).get("info", {}):
        done.append("data/master predates the test split and near-copy groups: run 'retrain merge --migrate-splits' "
                    "once (it says how many images change split, and records it), then 'dvc repro'")
    return done or ["nothing to upgrade: the workspace is this version's"]


def check_remote(paths: Paths) -> str:
    """Restore the committed version from the DVC remote as a new machine would; a line saying what was restored.

    ``dvc push`` and ``dvc status --cloud`` trust a directory whose manifest (``.dir``) is on the remote, so an
    object lost or never uploaded (a push cut off, a bucket edited) goes unseen by them.  This clones the
    workspace's HEAD into a temp folder (with ``.dvc/config.local``, where credentials may live), and ``dvc pull``s
    it into an empty cache, which re-hashes what it fetched (``verify true``, set by ``retrain init``).

    Raises:
        ExternalToolError: The remote cannot restore it; DVC's own lines say which objects.
    """
    head = git(["rev-parse", "--short", "HEAD"], paths.root, "git rev-parse").strip()
    remote = dvc(["remote", "default"], paths.root, "dvc remote default").strip()
    with tempfile.TemporaryDirectory(prefix="retrain-check-remote-") as tmp:
        clone = Path(tmp) / "clone"
        git(["clone", "-q", "--no-local", str(paths.root), str(clone)], Path(tmp), "git clone")
        local = paths.root / ".dvc" / "config.local"
        if local.is_file():
            shutil.copy2(local, clone / ".dvc" / "config.local")
        # What the commit records: the stages dvc.lock has run and the batches' .dvc files (a stage never run has
        # nothing to restore, and naming it would fail the pull).
        lock = yaml.safe_load((clone / "dvc.lock").read_text()) if (clone / "dvc.lock").is_file() else None
        targets = [*sorted((lock or {}).get("stages") or {}),
                   *sorted(p.relative_to(clone).as_posix() for p in (clone / "data").rglob("*.dvc"))]
        if not targets:
            return f"the DVC remote {remote}: {head} records no data yet (no batch ingested): nothing to restore"
        proc = subprocess.run([sys.executable, "-m", "dvc", "pull", *targets], cwd=clone, capture_output=True,
                              text=True, check=False, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        if proc.returncode != 0:
            out = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            first = next((i for i, ln in enumerate(out) if ln.startswith("ERROR")), len(out))
            noise = ("<http", "Is your", "Everything is up to date")
            said = [ln.removeprefix("ERROR: ") for ln in out[first:] if not ln.startswith(noise)]
            names = object_names(paths.root)
            lost = sorted({names.get(h, h) for h in re.findall(r"\b([0-9a-f]{32})\b", " ".join(said))})
            which = f"missing or damaged: {', '.join(lost[:10])}{' ...' if len(lost) > 10 else ''}; " if lost else ""
            raise ExternalToolError(f"the DVC remote {remote} cannot restore {head}: {which}"
                                    + (" ".join(said) or f"dvc pull exited {proc.returncode}")[:1500])
        files = sum(1 for p in (clone / "data").rglob("*") if p.is_file())
    return f"the DVC remote {remote} restores {head}: {files} files under data/ pulled into an empty cache and verified"


def object_names(root: Path) -> dict[str, str]:
    """What each DVC object of the committed outputs is: md5 -> workspace path (a file inside a tracked folder too).

    Read from ``dvc.lock``, the ``.dvc`` files under ``data/`` and the folder manifests (``.dir``) in the cache.
    """
    outs: list[dict[str, str]] = []
    docs = [root / "dvc.lock", *sorted((root / "data").rglob("*.dvc"))]
    for doc_path in docs:
        try:
            doc = yaml.safe_load(doc_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        base = doc_path.parent.relative_to(root)
        entries = [o for st in (doc.get("stages") or {}).values() for o in st.get("outs") or []] \
            if doc_path.name == "dvc.lock" else doc.get("outs") or []
        outs += [{"path": (base / str(o["path"])).as_posix(), "md5": str(o.get("md5", ""))} for o in entries
                 if isinstance(o, dict) and "path" in o]
    names: dict[str, str] = {}
    cache = root / ".dvc" / "cache" / "files" / "md5"
    for out in outs:
        md5 = out["md5"]
        names[md5.removesuffix(".dir")] = out["path"] + ("/ (its manifest)" if md5.endswith(".dir") else "")
        manifest = cache / md5[:2] / md5[2:]
        if md5.endswith(".dir") and manifest.is_file():
            try:
                for entry in json.loads(manifest.read_text()):
                    names.setdefault(entry["md5"], f"{out['path']}/{entry['relpath']}")
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return names


def master_dvc_md5(paths: Paths) -> str | None:
    """DVC's md5 of ``data/master`` as ``dvc.lock`` records it (the data version); ``None`` when it has none."""
    lock = paths.root / "dvc.lock"
    if not lock.is_file():
        return None
    doc = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    for out in ((doc.get("stages") or {}).get("merge") or {}).get("outs") or []:
        if out.get("path") == "data/master":
            return str(out.get("md5"))
    return None

"""Where the CLI keeps its state and how it prints: one resolution every command shares.

Each setting comes from the first source that sets it: a command-line flag, then the environment
(`DURABLY_DIR`, `DURABLY_STORAGE`, `NO_COLOR`, `DURABLY_RESTATE`, `DURABLY_RESTATE_ADMIN`, and the engine's
`DURABLY_LEASE`, `DURABLY_HEARTBEAT`, `DURABLY_POLL`, `DURABLY_CONCURRENCY`, `DURABLY_RETENTION`,
`DURABLY_IMPORT_RECORDED`, `DURABLY_CODE_ROOT`), then the project's
`.durably/config.toml` (the nearest `.durably/` folder in the current directory or a parent, found the way git
finds `.git`), then the user's `config.toml` under `platformdirs.user_config_dir("durably")`. Without any of
them the state dir is that nearest `.durably/`, else `./.durably`. The file keys are the flags' names: `dir`,
`storage`, `color`, `restate`, `restate_admin`, and the engine's `lease`, `heartbeat`, `poll`, `concurrency`,
`retention`, `import_recorded`, `code_root` (`ENGINE_KEYS`): every command that opens an engine applies them
(`durably run`, `retry`, `worker`, `ui`, ...), `durably worker` also its poll interval and retention. The files
may also declare resources (`[resources.NAME]`, `config_resources`), the project's over the user's, which every
command that opens an engine applies over the code's declarations.

The Restate admin URL belongs with its ingress URL: an admin URL from a lower source than the ingress URL's
(say the project file's, under a `--restate` flag) is not paired with it; the admin is then the ingress host
on port 9070, as when none is set.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._authoring.resources import Breaker, RateLimit, Resource
from .errors import ValidationError

STATE_DIR = ".durably"
CONFIG_FILE = "config.toml"
ENGINE_KEYS = ("lease", "heartbeat", "poll", "concurrency", "retention", "import_recorded", "code_root")
KEYS = ("dir", "storage", "color", "restate", "restate_admin", *ENGINE_KEYS)
ENV_NAMES = {name: f"DURABLY_{name.upper()}" for name in ENGINE_KEYS}
RESTATE_ADMIN_PORT = 9070

EXAMPLE_CONFIG = """\
# durably settings for this project. Every key is optional; command-line flags and the environment
# (DURABLY_DIR, DURABLY_STORAGE, NO_COLOR) override them. `durably config` shows what is in effect.

# The state dir, relative to the folder that holds this .durably/ folder (default: this .durably/ folder).
# dir = ".durably"

# A storage URL instead of a dir: a path, file:PATH, sqlite:PATH or postgresql://...
# storage = "sqlite:.durably/runs.db"

# false turns colours off, like NO_COLOR=1.
# color = true

# Operate runs on Restate (docs/restate.md): its ingress URL, and its admin URL (default: port 9070 of the
# ingress host). Like --restate / --restate-admin, or DURABLY_RESTATE / DURABLY_RESTATE_ADMIN.
# restate = "http://127.0.0.1:8080"
# restate_admin = "http://127.0.0.1:9070"

# The engine and `durably worker` (docs/deploying.md); flags and DURABLY_LEASE, DURABLY_HEARTBEAT, DURABLY_POLL,
# DURABLY_CONCURRENCY, DURABLY_RETENTION, DURABLY_IMPORT_RECORDED, DURABLY_CODE_ROOT override them.
# lease = 30              # seconds a claimed run stays held without renewal (at least 1)
# heartbeat = 10          # seconds between renewals (default: a third of the lease)
# poll = 0.2              # seconds between a worker's looks at the queue when idle
# concurrency = 4         # runs (and child runs) at once
# retention = "30d"       # a worker deletes runs this long after they ended
# import_recorded = false # a worker may import the module or script a run recorded (under code_root)
# code_root = "."         # where recorded code may come from (default: the folder holding .durably/)
"""

EXAMPLE_GITIGNORE = """\
# Run logs and other state stay out of git; config.toml and this file are meant to be committed.
*
!.gitignore
!config.toml
"""


@dataclass
class Settings:
    """The effective settings and, for each, where it came from."""

    dir: str | None = None
    storage: str | None = None
    color: bool = True
    restate: str | None = None
    restate_admin: str | None = None
    lease: float | None = None
    heartbeat: float | None = None
    poll: float | None = None
    concurrency: int | None = None
    retention: float | None = None
    import_recorded: bool = False
    code_root: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Resource] = field(default_factory=dict)  # `[resources.NAME]` of the config files
    project: Path | None = None
    user_file: Path | None = None

    def location(self) -> str:
        """The state dir or storage URL the commands use, as a user would type it."""
        return self.storage if self.storage is not None else str(self.dir)

    def to_dict(self) -> dict[str, Any]:
        """JSON form for `durably config --json`."""
        return {"dir": self.dir, "storage": self.storage, "color": self.color, "restate": self.restate,
                "restate_admin": self.restate_admin, **{name: getattr(self, name) for name in ENGINE_KEYS},
                "sources": dict(self.sources),
                "resources": {name: {"concurrency": r.concurrency,
                                     "rate_limit": None if r.rate_limit is None else
                                     {"max": r.rate_limit.max, "per": r.rate_limit.per,
                                      "window": r.rate_limit.window},
                                     "breaker": None if r.breaker is None else
                                     {"failure_rate": r.breaker.failure_rate, "window": r.breaker.window,
                                      "cooldown": r.breaker.cooldown, "min_calls": r.breaker.min_calls}}
                              for name, r in self.resources.items()},
                "project": str(self.project) if self.project else None,
                "user_config": str(self.user_file) if self.user_file else None}


def find_state_dir(start: Path | None = None) -> Path | None:
    """The nearest `.durably/` folder in `start` (default: the current directory) or one of its parents."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / STATE_DIR
        if candidate.is_dir():
            return candidate
    return None


def user_config_file() -> Path:
    """The user's config file: `config.toml` under `platformdirs.user_config_dir("durably")`."""
    import platformdirs  # only commands that resolve settings pay for it

    return Path(platformdirs.user_config_dir("durably")) / CONFIG_FILE


def read_config(path: Path) -> dict[str, Any]:
    """The settings in one config file (empty when it does not exist); unknown keys and bad values are errors."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValidationError(f"cannot read config file {path}: {exc.strerror or exc}",
                              hint="Fix the file's permissions, or remove it.", docs="docs/cli.md#configuration") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValidationError(f"config file {path} is not valid TOML: {exc}",
                              hint='Write one key per line, e.g. dir = ".durably".',
                              docs="docs/cli.md#configuration") from None
    if "resources" in data:
        data["resources"] = config_resources(data["resources"], f"config file {path}")
    for name, value in data.items():
        if name == "resources":
            continue
        if name not in KEYS:
            raise ValidationError(f"config file {path} has unknown key {name!r}",
                                  hint=f"The keys are {', '.join(KEYS)}.", docs="docs/cli.md#configuration")
        if name in ENGINE_KEYS:
            data[name] = engine_value(name, value, f"config file {path}: {name}")
            continue
        expected = bool if name == "color" else str
        if not isinstance(value, expected):
            raise ValidationError(f"config file {path}: {name} must be a {expected.__name__}, got {value!r}",
                                  hint='e.g. dir = ".durably", color = false.', docs="docs/cli.md#configuration")
        if name.startswith("restate") and isinstance(value, str):
            check_url(value, f"config file {path}: {name}")
    return data


RESOURCE_HINT = ('e.g. [resources.openai] concurrency = 8, rate_limit = { max = 60, per = "1m" }, '
                 "breaker = { failure_rate = 0.5, window = 30, cooldown = 10 }")


def config_resources(table: Any, what: str) -> dict[str, Resource]:
    """The resources a config file's `[resources.NAME]` tables declare (the same as `durably_py.resource(NAME,
    ...)`): `concurrency`, `rate_limit = {max, per[, window]}`, `breaker = {failure_rate, window, cooldown[,
    min_calls]}`; durations as seconds or text ("1m"). Anything else is a `ValidationError` naming `what`."""
    if not isinstance(table, dict):
        raise ValidationError(f"{what}: resources must be tables [resources.NAME], got {table!r}",
                              hint=RESOURCE_HINT, docs="docs/policies.md#resources")
    found: dict[str, Resource] = {}
    for name, spec in table.items():
        where = f"{what}: resources.{name}"
        if not isinstance(spec, dict) or set(spec) - {"concurrency", "rate_limit", "breaker"}:
            raise ValidationError(f"{where} takes concurrency, rate_limit and breaker, got {spec!r}",
                                  hint=RESOURCE_HINT, docs="docs/policies.md#resources")
        try:
            rate, breaker = spec.get("rate_limit"), spec.get("breaker")
            found[name] = Resource(
                name, concurrency=spec.get("concurrency"),
                rate_limit=None if rate is None else RateLimit(
                    rate.get("max"), _seconds(rate.get("per")), rate.get("window", "sliding")),
                breaker=None if breaker is None else Breaker(
                    breaker.get("failure_rate"), _seconds(breaker.get("window")), _seconds(breaker.get("cooldown")),
                    breaker.get("min_calls", 5)))
        except ValidationError as exc:
            raise ValidationError(f"{where}: {exc.message}", hint=RESOURCE_HINT,
                                  docs="docs/policies.md#resources") from None
        except (AttributeError, TypeError):
            raise ValidationError(f"{where}: rate_limit and breaker are tables, got {spec!r}", hint=RESOURCE_HINT,
                                  docs="docs/policies.md#resources") from None
    return found


def _seconds(value: Any) -> Any:
    """A duration from a config value: seconds as a number, or text such as "1m" (anything else is passed on,
    for the resource's own check to refuse)."""
    return parse_duration(value) if isinstance(value, str) else value


def parse_duration(text: str) -> float:
    """Seconds from a duration such as `30s`, `5m`, `2h`, `1d`, `1h30m` or a bare number of seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    spec = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", spec):
        return float(spec)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", spec)
    if not parts or "".join(n + u for n, u in parts) != spec:
        raise ValidationError(f"invalid duration {text!r}", hint="Write durations like 30s, 5m, 2h or 1h30m.")
    return sum(float(n) * units[u] for n, u in parts)


def engine_value(name: str, value: Any, what: str) -> Any:
    """An engine setting (`ENGINE_KEYS`) from a config file's TOML value or an environment variable's text:
    seconds (a number, or a duration text like "30s") for lease, heartbeat, poll and retention, an int for
    concurrency, a bool for import_recorded, a path for code_root. The engine checks the ranges."""
    hint = ("e.g. lease = 12, heartbeat = 4, poll = 0.2, concurrency = 8, retention = \"30d\", "
            "import_recorded = true, code_root = \".\" (DURABLY_LEASE=12, DURABLY_RETENTION=30d, ...).")
    if name == "code_root":
        if isinstance(value, str) and value:
            return value
    elif name == "import_recorded":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return not _falsy(value)
    elif name == "concurrency":
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, str):
        try:
            return parse_duration(value)
        except ValidationError:
            pass
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValidationError(f"{what}: {value!r} is not a valid {name}", hint=hint, docs="docs/deploying.md#settings")


def check_url(url: str, what: str) -> str:
    """`url` if it is an http(s) URL with a host, else a `ValidationError` naming `what`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError(f"{what} must be an http:// or https:// URL, got {url!r}",
                              hint="e.g. http://127.0.0.1:8080 for the ingress, http://127.0.0.1:9070 for the admin API.",
                              docs="docs/restate.md#operating-runs")
    return url


def default_restate_admin(ingress: str) -> str:
    """The admin URL that goes with a Restate ingress URL when none is set: the same host, port 9070."""
    parts = urllib.parse.urlsplit(ingress)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{parts.scheme}://{host}:{RESTATE_ADMIN_PORT}"


def _falsy(value: str) -> bool:
    return value.strip().lower() in ("0", "false", "no", "off")


def resolve(dir: str | None = None, storage: str | None = None, *, restate: str | None = None,
            restate_admin: str | None = None, cwd: Path | None = None,
            environ: dict[str, str] | None = None) -> Settings:
    """The effective settings: flags (`dir`, `storage`, `restate`, `restate_admin`) > environment > project
    config > user config > discovery."""
    env = os.environ if environ is None else environ
    base = (cwd or Path.cwd()).resolve()
    if dir is not None and storage is not None:
        raise ValidationError("--dir and --storage name two different places", hint="Pass only one of them.",
                              docs="docs/cli.md#configuration")
    if dir is not None and Path(dir).exists() and not Path(dir).is_dir():
        raise ValidationError(f"--dir {dir!r} is a file, not a directory",
                              hint="Pass the state dir (a folder such as .durably), not a file in it.",
                              docs="docs/cli.md#configuration")
    project = find_state_dir(base)
    user_file = user_config_file()
    settings = Settings(project=project, user_file=user_file)
    layers: list[tuple[dict[str, str], dict[str, Any], Path]] = []
    if any(flag is not None for flag in (dir, storage, restate, restate_admin)):
        layers.append(({"dir": "--dir", "storage": "--storage", "restate": "--restate",
                        "restate_admin": "--restate-admin"},
                       {"dir": dir, "storage": storage, "restate": restate, "restate_admin": restate_admin}, base))
    env_layer: dict[str, Any] = {"dir": env.get("DURABLY_DIR") or None, "storage": env.get("DURABLY_STORAGE") or None,
                                 "restate": env.get("DURABLY_RESTATE") or None,
                                 "restate_admin": env.get("DURABLY_RESTATE_ADMIN") or None}
    env_names = {"dir": "$DURABLY_DIR", "storage": "$DURABLY_STORAGE", "color": "$NO_COLOR",
                 "restate": "$DURABLY_RESTATE", "restate_admin": "$DURABLY_RESTATE_ADMIN"}
    for name, variable in ENV_NAMES.items():
        if env.get(variable):
            env_layer[name] = engine_value(name, env[variable], f"${variable}")
            env_names[name] = f"${variable}"
    if "NO_COLOR" in env and env["NO_COLOR"] != "":
        env_layer["color"] = False
    elif env.get("DURABLY_COLOR"):
        env_layer["color"] = not _falsy(env["DURABLY_COLOR"])
        env_names["color"] = "$DURABLY_COLOR"
    layers.append((env_names, env_layer, base))
    files = [(project / CONFIG_FILE, project.parent)] if project is not None else []
    for path, root in [*files, (user_file, base)]:
        layers.append((dict.fromkeys(KEYS, str(path)), read_config(path), root))

    _resolve_restate(settings, [(names, values) for names, values, _ in layers])
    for names, values, root in layers:
        if "dir" not in settings.sources and "storage" not in settings.sources:
            if values.get("storage") is not None:
                settings.storage = values["storage"]
                settings.sources["storage"] = names["storage"]
            elif values.get("dir") is not None:
                settings.dir = str((root / os.path.expanduser(values["dir"])).resolve())
                settings.sources["dir"] = names["dir"]
        if "color" not in settings.sources and values.get("color") is not None:
            settings.color = bool(values["color"])
            settings.sources["color"] = names["color"]
        for name in ENGINE_KEYS:
            if name not in settings.sources and values.get(name) is not None:
                value = values[name]
                setattr(settings, name, str((root / os.path.expanduser(value)).resolve()) if name == "code_root"
                        else value)
                settings.sources[name] = names[name]
    for _, values, _ in reversed(layers):  # the user's file, then the project's: a name declared in both is the project's
        settings.resources.update(values.get("resources", {}))
    if "dir" not in settings.sources and "storage" not in settings.sources:
        settings.dir = str(project if project is not None else base / STATE_DIR)
        settings.sources["dir"] = "nearest .durably/" if project is not None else "default"
    settings.sources.setdefault("color", "default")
    check_engine(settings)
    return settings


def check_engine(settings: Settings) -> None:
    """Check the engine settings' ranges now, so a bad value from the environment or a config file is a usage
    error naming its source before any command runs (the engine checks them again when it applies them)."""
    from ._engine.heartbeat import check_lease
    from ._engine.runs import check_retention
    from ._worker.worker import check_concurrency, check_poll

    checks: list[tuple[tuple[str, ...], Any]] = [
        (("lease", "heartbeat"), lambda: check_lease(30.0 if settings.lease is None else settings.lease,
                                                     settings.heartbeat)),
        (("concurrency",), lambda: check_concurrency(settings.concurrency)),
        (("poll",), lambda: check_poll(settings.poll)), (("retention",), lambda: check_retention(settings.retention))]
    for names, check in checks:
        given = [name for name in names if getattr(settings, name) is not None]
        if not given:
            continue
        try:
            check()
        except ValidationError as exc:
            sources = " and ".join(dict.fromkeys(settings.sources.get(name, name) for name in given))
            raise ValidationError(f"{sources}: {exc.message}", hint=exc.hint, docs=exc.docs) from None


def _resolve_restate(settings: Settings, layers: list[tuple[dict[str, str], dict[str, Any]]]) -> None:
    """The Restate URLs: each from the first layer that sets it, the admin only from the ingress's layer or above.

    Where runs live is one choice: a state dir or storage URL from a higher layer than the ingress URL (a
    `--dir` flag over a project file's `restate`) means local runs, and no ingress URL is in effect (the admin
    URL still is, for `durably serve --restate`)."""
    ingress_level = admin_level = len(layers)
    location = next((level for level, (_, values) in enumerate(layers)
                     if values.get("dir") is not None or values.get("storage") is not None), len(layers))
    for level, (names, values) in enumerate(layers):
        if settings.restate is None and values.get("restate"):
            settings.restate = check_url(values["restate"], names["restate"])
            settings.sources["restate"] = names["restate"]
            ingress_level = level
        if settings.restate_admin is None and values.get("restate_admin"):
            settings.restate_admin = check_url(values["restate_admin"], names["restate_admin"])
            settings.sources["restate_admin"] = names["restate_admin"]
            admin_level = level
    if ingress_level > location:
        settings.restate = None
        settings.sources.pop("restate", None)
    elif settings.restate is not None and admin_level > ingress_level:
        settings.restate_admin = default_restate_admin(settings.restate)
        settings.sources["restate_admin"] = "default: the ingress host, port 9070"


def override(settings: Settings, name: str, value: Any, flag: str) -> None:
    """Set engine setting `name` from a command-line `flag` (None: the flag was not given)."""
    if value is not None:
        setattr(settings, name, value)
        settings.sources[name] = flag


def project_root(settings: Settings) -> str:
    """The folder holding the project's `.durably/` (where recorded code may come from by default), else the
    current directory."""
    return str(settings.project.parent if settings.project is not None else Path.cwd())
def ignore_in_git(state: Path) -> Path | None:
    """Before a run makes the state dir `state` inside a git work tree, write there the self-ignoring `.gitignore`
    that `durably init` writes, so run logs never show in `git status`; the file written, else None (the dir
    exists already, or no `.git` above it)."""
    parent = state.resolve().parent
    if state.exists() or not any((folder / ".git").exists() for folder in (parent, *parent.parents)):
        return None
    state.mkdir(parents=True, exist_ok=True)
    target = state / ".gitignore"
    target.write_text(EXAMPLE_GITIGNORE, encoding="utf-8")
    return target


def init_project(folder: Path) -> list[Path]:
    """Create `.durably/` with an example `config.toml` and a `.gitignore` in `folder`; return what was created."""
    state = folder / STATE_DIR
    made = []
    if not state.is_dir():
        state.mkdir(parents=True)
        made.append(state)
    for name, text in ((CONFIG_FILE, EXAMPLE_CONFIG), (".gitignore", EXAMPLE_GITIGNORE)):
        target = state / name
        if not target.exists():
            target.write_text(text, encoding="utf-8")
            made.append(target)
    return made


__all__ = ["Settings", "find_state_dir", "ignore_in_git", "init_project", "read_config", "resolve",
           "user_config_file"]

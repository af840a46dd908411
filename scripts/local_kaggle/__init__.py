"""A local Kaggle: an HTTP server that the real `kaggle` CLI and kagglesdk talk to unchanged.

The client is pointed at it with environment variables (see `LocalKaggle.client_env`):

    KAGGLE_API_ENVIRONMENT=LOCALHOST   # before `import kaggle`: the client POSTs to http://localhost/api/v1/...
    HTTP_PROXY=http://127.0.0.1:PORT   # ...which the proxy setting delivers to this server, on any port
    NO_PROXY=""                        # localhost must not bypass the proxy
    KAGGLE_USERNAME=... KAGGLE_KEY=... # basic auth, checked against <root>/users.json (a legacy key)
    KAGGLE_API_TOKEN=KGAT_...          # or a new-style API token, sent as bearer (<root>/api_tokens.json)

Served: kernels push/status/output/logs/list/pull/cancel, datasets create/version/status/files/download/
list/metadata and its update (with the blob upload the client does: StartBlobUpload, then a resumable PUT to a URL
on this server), accelerator quota, token introspection (a session's own token states its scope and expiry: it can
be made to expire mid-session or at the session's end, answering 401, or to be refused writes; its scope refuses
nothing). Each pushed kernel version runs as `python <code_file>` in a subprocess with Kaggle's filesystem under
`<root>/kernels/<owner>/<slug>/<version>/kaggle/`: `input/<slug>/` (read-only by permissions), `working/` (its
output, capped), `temp/`; `shared.kaggle.env` finds them from the LOCAL_KAGGLE_* variables. Sessions are
hard-killed at the session limit and count weekly accelerator quota.
Faults (HTTP errors on chosen calls, a session that errors, a kill at a chosen moment) can be injected for tests.
All state is on disk under --root, so a restarted server keeps datasets, kernel versions and outputs.

The API speaks kagglesdk's own types: each route's request and reply types are read from kagglesdk's service
clients (SDK_ROUTES), a request body is read with the request type's from_dict, and a reply is an instance of
the reply type built through its typed setters (`message`) and written as its JSON (`to_wire`), so a reply
cannot carry a field kagglesdk does not have. docs/kaggle-api.md lists the calls, with sources.

    python -m scripts.local_kaggle serve --root DIR --port N [--session-limit S] [--working-cap-gb G]
        [--quota-hours H] [--gpu-quota-hours H] [--user NAME:KEY ...] [--faults FILE]
    python -m scripts.local_kaggle user-add --root DIR NAME        (key read from stdin)
    python -m scripts.local_kaggle token-add --root DIR NAME       (prints a new API token, KGAT_...)
    python -m scripts.local_kaggle secret-attach --root DIR OWNER/SLUG NAME  (value read from stdin)

(Run from the repository root, so that `scripts` is importable.)

How it differs from Kaggle, on purpose or by necessity:
- KAGGLE_API_ENVIRONMENT is read when `kaggle.api.kaggle_api_extended` is first imported (a class attribute),
  so set it before any `import kaggle`.
- A session's environment carries no Kaggle credentials (read KAGGLE_USERNAME/KAGGLE_KEY with
  `shared.kaggle.secrets.get_secret`); KAGGLE_API_ENVIRONMENT is set only when enable_internet is true. All its
  HTTP(S) goes through this server, which serves the Kaggle API and refuses every other host (no internet),
  except, with internet on, the package index, so a kernel can pip-install what its image lacks, as on Kaggle.
- A session runs in the interpreter of its machine's image (`rules.image_pythons`: .venv-kaggle-tpu for TPU
  shapes, .venv-kaggle-cpu for CPU and GPU ones, made by `bash scripts/setup.sh --kaggle-image`; this Python
  where they are missing), with that image's packages and none it lacks.
- Secrets belong to a notebook, attached once it exists (`attach_secret`, as on its Kaggle page); a new
  notebook has none. A QUICK_SAVE push saves a version without running it (status COMPLETE, no output).
- A session killed at the time limit, by quota, by the working cap, by a fault or by a server stop ends as
  ERROR with the reason as failure message, and its /kaggle/working output is discarded; a kernel that exits
  non-zero ends as ERROR and keeps its output. `kernels output` serves the newest finished version.
- Inputs are read-only by permissions only (root can still write them). Python kernels only; notebooks run
  their code cells in order (magics skipped). Concurrent sessions: 1 TPU, 2 GPU, 5 CPU; more wait queued.
- Weekly quota resets Saturday 00:00 UTC; a TPU/GPU push with no quota left returns an error in the push
  response (`Kernel push error: ...`), and a running session is stopped when the quota runs out.
- CancelKernelSession takes a kernelSessionId, as on Kaggle; no reply carries one, so read it from
  `LocalKaggle.session_id(ref)` or <root>/state.json (`versions[].session_id`).

The package, one concern a module, each handed only the parts it uses (no import cycle; `kernels` uses
`server`'s proxy settings, the rest import only modules listed before them):
`rules` (Kaggle's shapes and limits, `ApiError`, `Settings`, injected `Faults`), `state` (state.json, users and
notebooks' secrets, weekly quota), `datasets` (datasets, blob uploads), `kernels` (pushes, the scheduler, sessions),
`api` (the routes in kagglesdk's types), `server` (HTTP), `app` (`LocalKaggle`, composing the rest); `__main__` is
the command line.
"""

from .api import API_ROUTES, SDK_ROUTES, ApiParts, call_api, message, to_wire
from .app import LocalKaggle
from .kernels import notebook_to_script
from .rules import (
    DEFAULT_CONCURRENCY,
    DEFAULT_GPU_QUOTA_HOURS,
    DEFAULT_GPU_SHAPE,
    DEFAULT_SESSION_LIMIT_S,
    DEFAULT_TPU_QUOTA_HOURS,
    DEFAULT_TPU_SHAPE,
    DEFAULT_WORKING_CAP_BYTES,
    MACHINE_SHAPES,
    SLUG_RE,
    TERMINAL,
    ApiError,
    Faults,
    Settings,
)
from .server import ADMIN_HEADER, admin_call
from .sessions import Session

__all__ = [
    "ADMIN_HEADER", "API_ROUTES", "DEFAULT_CONCURRENCY", "DEFAULT_GPU_QUOTA_HOURS", "DEFAULT_GPU_SHAPE",
    "DEFAULT_SESSION_LIMIT_S", "DEFAULT_TPU_QUOTA_HOURS", "DEFAULT_TPU_SHAPE", "DEFAULT_WORKING_CAP_BYTES",
    "MACHINE_SHAPES", "SDK_ROUTES", "SLUG_RE", "TERMINAL", "ApiError", "ApiParts", "Faults", "LocalKaggle", "Session",
    "Settings", "admin_call", "call_api", "message", "notebook_to_script", "to_wire",
]

"""llmgw's settings: every value comes from the environment, with defaults that
run everything on one machine (SQLite and the mirror under var/, a local Redis).

LLMGW_ROLE says which of the control plane's processes this is:
- control (the default): the admin server, the control worker and its beat.
- gateway: `manage.py gateway`, /v1/ on its own port: no Django request handling at all,
  only the models it reads its table through.
- bytes: the byte listener; its own URLconf, no sessions, auth or admin: it serves
  files and manifests to nodes and nothing else.
A node's agent does not run these settings at all: `manage.py agent` and `fetch` run
with the node's own, agent.settings (no database, nothing of the control plane).
"""

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from contracts.env import SettingError, env_addr, env_bool, env_float, env_int, env_path, env_str
from contracts.version import VERSION
from llmgw_site.setting_readers import env_list, env_networks, env_time_zone, oidc_issuer_host, port_range, secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = env_path("LLMGW_VAR", Path("var"), BASE_DIR)

# The control plane's processes. A node is none of them: its settings are agent.settings.
ROLES = ("control", "bytes", "gateway")
ROLE = env_str("LLMGW_ROLE", "control")
if ROLE not in ROLES:
    raise ImproperlyConfigured(
        f"LLMGW_ROLE must be one of {', '.join(ROLES)}, not {ROLE!r}"
        + (
            "; a node runs with its own settings, agent.settings, which manage.py agent and fetch choose"
            if ROLE == "node"
            else ""
        )
    )

SECRET_KEY = secret_key(VAR_DIR)

# A key made here is one machine's: `check --deploy` refuses it for a fleet (llmgw_site/checks.py).
SECRET_KEY_MADE_HERE = not env_str("DJANGO_SECRET_KEY", "")

DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "*")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", "")

# The admin port behind a TLS proxy (docs/fleet.md): the proxy says the request came over
# HTTPS, plain HTTP is sent there, cookies travel only over it, and browsers are told to
# keep to it (HSTS). `manage.py check --deploy` is clean with it on.
HTTPS = env_bool("LLMGW_HTTPS", False)
if HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("LLMGW_HSTS_S", 31536000, minimum=0)
    # Whether every subdomain, and the browsers' preload list, go HTTPS-only is the
    # domain owner's decision, not one an application can make for them.
    SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]

# --- where things are -------------------------------------------------------

MIRROR_ROOT = env_path("LLMGW_MIRROR_ROOT", VAR_DIR / "mirror", BASE_DIR)
ADMIN_ADDR = env_addr("LLMGW_ADMIN_ADDR", "127.0.0.1:8000")
BYTES_ADDR = env_addr("LLMGW_BYTES_ADDR", "127.0.0.1:8001")
# The byte listener as nodes reach it, which is not always where it listens
# (0.0.0.0 is an address to bind, not one to connect to).
_bytes_host = "127.0.0.1" if BYTES_ADDR[0] in {"0.0.0.0", "::", ""} else BYTES_ADDR[0]
BYTES_URL = env_str("LLMGW_BYTES_URL", f"http://{_bytes_host}:{BYTES_ADDR[1]}/").rstrip("/") + "/"
if ROLE == "bytes":
    # Nodes reach the byte listener by its own address (LLMGW_BYTES_URL), not the admin's name in
    # DJANGO_ALLOWED_HOSTS: it shares control.env, and a manifest's addresses are built from the
    # Host a node sends, so that Host is the one allowed (issue 41.1).
    from urllib.parse import urlsplit

    ALLOWED_HOSTS = env_list("LLMGW_BYTES_ALLOWED_HOSTS", urlsplit(BYTES_URL).hostname or _bytes_host)
MIRROR_SCAN_INTERVAL_S = env_int("LLMGW_SCAN_INTERVAL_S", 20, minimum=1)
HEARTBEAT_S = env_int("LLMGW_HEARTBEAT_S", 15, minimum=1)
# A node is not ready after this many heartbeats in a row have not arrived.
HEARTBEATS_MISSED = env_int("LLMGW_HEARTBEATS_MISSED", 3, minimum=1)
# How often a running agent probes its installed engines and GPUs again.
AGENT_REPROBE_S = env_int("LLMGW_AGENT_REPROBE_S", 300, minimum=1)
# The agent's cache on a node: fetched files and sets, under <host>_<port>/<path>.
AGENT_CACHE = env_path("LLMGW_AGENT_CACHE", VAR_DIR / "agent-cache", BASE_DIR)
# Files of one set fetched at once: one TCP stream rarely fills a fast link.
FETCH_PARALLEL = env_int("LLMGW_FETCH_PARALLEL", 4, minimum=1)
RECONCILE_INTERVAL_S = env_int("LLMGW_RECONCILE_INTERVAL_S", 5, minimum=1)
# Ports a worker of a replica across nodes listens at (its fenced transport, issue 37): FIRST-LAST.
RPC_PORTS = env_str("LLMGW_RPC_PORTS", "50100-50199")
RPC_PORT_RANGE = port_range("LLMGW_RPC_PORTS", RPC_PORTS)
# Engines may be told to run code shipped with the weights (vLLM's --trust-remote-code)
# only when this is set: the mirror is a place files are copied into by hand.
LLMGW_ALLOW_REMOTE_CODE = env_bool("LLMGW_ALLOW_REMOTE_CODE", False)
# Where engines listen on a node, and the host the gateway reaches them by.
LLMGW_ENGINE_HOST = env_str("LLMGW_ENGINE_HOST", "127.0.0.1")
LLMGW_ENGINE_ADVERTISE = env_str("LLMGW_ENGINE_ADVERTISE", "")
# The byte listener serves only the fleet's nodes (each with a pass made from its token);
# true serves the mirror to anyone who reaches it.
BYTES_PUBLIC = env_bool("LLMGW_BYTES_PUBLIC", False)
# Connections one byte-listener process holds at once (gevent: each costs a greenlet, not a thread).
BYTES_CONNECTIONS = env_int("LLMGW_BYTES_CONNECTIONS", 10000, minimum=1)
# A connection whose request head has not arrived within this time is closed, kept-alive idle ones too.
BYTES_HEADER_TIMEOUT_S = env_int("LLMGW_BYTES_HEADER_TIMEOUT_S", 10, minimum=1)
# gunicorn's worker heartbeat timeout; it bounds a stuck worker, not a long download (the hub beats between sends).
BYTES_WORKER_TIMEOUT_S = env_int("LLMGW_BYTES_WORKER_TIMEOUT_S", 120, minimum=1)
BYTES_WORKERS = env_int("LLMGW_BYTES_WORKERS", 2, minimum=1)
# The byte listener's access log, gunicorn's, on stdout: true or false (it was on for any value, "false" too).
BYTES_ACCESS_LOG = env_bool("LLMGW_ACCESS_LOG", False)
# How long a byte-listener process believes a node's token hash once read (fleet.enrolment.EnrolledNodes):
# a revoked token is refused within this many seconds. 0 reads the database for every pass.
BYTES_PASS_CACHE_S = env_float("LLMGW_BYTES_PASS_CACHE_S", 2.0)
# Proxies in front of the byte listener whose X-Forwarded-For is believed (addresses or networks):
# the tracker takes a node's address from the request, and from a proxy's header only if it is one of these.
BYTES_TRUSTED_PROXIES = env_networks("LLMGW_BYTES_TRUSTED_PROXIES")
# --- a version offered whole or not at all (docs/mirror.md, "Not ready yet") ---
# A file modified less than this long ago is taken to be still being copied in: its
# version's manifest says "not ready" (503, Retry-After) until it has been still this long.
MIRROR_SETTLE_S = env_int("LLMGW_MIRROR_SETTLE_S", 10)
# Unhashed bytes the byte listener hashes inside a manifest request; more is hashed in the
# background while the manifest says "not ready" with a Retry-After.
MIRROR_HASH_INLINE_BYTES = env_int("LLMGW_MIRROR_HASH_INLINE_BYTES", 256 * 1024 * 1024)
# Pulls from another mirror (mirror/pull.py, issue 34): how long one may take in all, how long the
# admin's form waits for the other mirror's answer, whether plain http is allowed, and the space a pull
# must leave free on the mirror's filesystem.
PULL_DEADLINE_S = env_int("LLMGW_PULL_DEADLINE_S", 6 * 3600, minimum=1)
PULL_CHECK_S = env_int("LLMGW_PULL_CHECK_S", 5, minimum=1)
PULL_ALLOW_HTTP = env_bool("LLMGW_PULL_ALLOW_HTTP", False)
PULL_RESERVE_BYTES = env_int("LLMGW_PULL_RESERVE_MB", 1024, minimum=0) << 20
# How long a node's fetch waits on a version the mirror says is not ready before it fails.
FETCH_WAIT_S = env_int("LLMGW_FETCH_WAIT_S", 6 * 3600, minimum=1)
# `manage.py up` puts a tiny demo GGUF into the mirror (tiny-demo/v1) unless one is there.
DEMO_MODEL = env_bool("LLMGW_DEMO_MODEL", True)
# Models declared in configuration (YAML), loaded at migrate and by `manage.py catalog_load`.
CATALOG_FILE = env_path("LLMGW_CATALOG", Path(""), BASE_DIR) if env_str("LLMGW_CATALOG", "") else None
# The gateway: /v1/ on a port of its own (`manage.py gateway`), in LLMGW_GATEWAY_WORKERS processes.
GATEWAY_ADDR = env_addr("LLMGW_GATEWAY_ADDR", "127.0.0.1:8080")
GATEWAY_WORKERS = env_int("LLMGW_GATEWAY_WORKERS", 1, minimum=1)
# The gateway as clients reach it, named by the admin port's 404 for /v1/ (0.0.0.0 is not an address to call).
_gateway_host = "127.0.0.1" if GATEWAY_ADDR[0] in {"0.0.0.0", "::", ""} else GATEWAY_ADDR[0]
GATEWAY_URL = env_str("LLMGW_GATEWAY_URL", f"http://{_gateway_host}:{GATEWAY_ADDR[1]}/").rstrip("/") + "/"
# Usage counted by a gateway is written here first and to the database from here (docs/gateway.md),
# so a database outage, or a gateway restarted during one, loses none of it.
GATEWAY_SPOOL = env_path("LLMGW_GATEWAY_SPOOL", VAR_DIR / "gateway-spool", BASE_DIR)
# How often the gateway re-reads models, replicas and keys, in milliseconds.
GATEWAY_REFRESH_MS = env_int("LLMGW_GATEWAY_REFRESH_MS", 1000, minimum=50)
# How long a replica may take to start answering (headers) before the request fails, in seconds.
GATEWAY_UPSTREAM_TIMEOUT_S = env_int("LLMGW_GATEWAY_UPSTREAM_TIMEOUT_S", 600, minimum=1)
# A replica's host that acknowledges nothing the gateway sends for this long is gone (gateway/upstream.py).
GATEWAY_UPSTREAM_LOST_S = env_int("LLMGW_GATEWAY_UPSTREAM_LOST_S", 15, minimum=1)
# The largest request body the gateway reads, in bytes.
GATEWAY_MAX_BODY = env_int("LLMGW_GATEWAY_MAX_BODY", 32 * 1024 * 1024, minimum=1024)
# Requests (and connections) one gateway process takes at once; uvicorn answers 503 past it.
GATEWAY_CONCURRENCY = env_int("LLMGW_GATEWAY_CONCURRENCY", 4096, minimum=1)
# Requests one key may have in one gateway process at once, whatever its own limits (docs/gateway.md).
GATEWAY_KEY_CONCURRENCY = env_int("LLMGW_GATEWAY_KEY_CONCURRENCY", 256, minimum=1)
# A limited key's request goes on without waiting for Redis's answer while what this process last heard of
# the key's counters, plus what it asked since, is below this share of every limit (gateway/limits/); 0: always wait.
LIMITS_FAST_SHARE = env_float("LLMGW_LIMITS_FAST_SHARE", 0.5)
if LIMITS_FAST_SHARE > 1:
    raise SettingError("LLMGW_LIMITS_FAST_SHARE is a share of each limit, from 0 (always wait) to 1, not more")
# Whether clients see how many of their prompt's tokens the engine had cached (cached_tokens): only where
# every key is one tenant, since the cache is shared and its count tells one key what another sent.
GATEWAY_SHOW_CACHED_TOKENS = env_bool("LLMGW_GATEWAY_SHOW_CACHED_TOKENS", False)
# The time zone whose calendar days and months the gateway's daily and monthly limits and teams' budgets
# count in (docs/teams.md): a month's budget resets at midnight on the 1st there.
BUDGET_TIME_ZONE = env_time_zone("LLMGW_BUDGET_TIME_ZONE", "UTC")
# Body keys the gateway passes on besides those of each address's API (gateway/intake.py PASSED), comma-separated.
GATEWAY_ENGINE_KEYS = frozenset(env_list("LLMGW_GATEWAY_ENGINE_KEYS", ""))
# Holding (docs/gateway.md): a request for a model with no ready replica, but one on its way,
# waits this many seconds for it (0: refused at once, as before), in a queue of at most
# LLMGW_HOLD_QUEUE requests per model and gateway process.
HOLD_S = env_int("LLMGW_HOLD_S", 300, minimum=0)
HOLD_QUEUE = env_int("LLMGW_HOLD_QUEUE", 256, minimum=1)
# Of those, how many one key may have waiting for one model: a queue shared between keys.
HOLD_QUEUE_PER_KEY = env_int("LLMGW_HOLD_QUEUE_PER_KEY", 64, minimum=1)
# Prefix routing's bound (gateway/prefix.py): a replica takes a conversation's request while its requests
# in flight stay within the larger of its slots times PREFIX_SLOT_MARGIN and the model's average per
# replica times PREFIX_LOAD_BOUND; past it, the next on the ring does.
# 1 would be no slack at all; below 1 no replica could ever take the request.
PREFIX_LOAD_BOUND = env_float("LLMGW_PREFIX_LOAD_BOUND", 1.25, minimum=1.0)
PREFIX_SLOT_MARGIN = env_float("LLMGW_PREFIX_SLOT_MARGIN", 1.25, minimum=0.0)
# A conversation's first turn starts on the replica with the fewest in flight, remembered for its later
# turns (gateway/conversations.py); false places it on its key's owner, as before issue 39.
PREFIX_OPEN_BY_LOAD = env_bool("LLMGW_PREFIX_OPEN_BY_LOAD", True)
# Threads that run Django's own pages (admin, API) beside the gateway in the admin server.
ADMIN_THREADS = env_int("LLMGW_ADMIN_THREADS", 16, minimum=1)
# Processes `manage.py admin_server` runs on the admin port (its --workers); each has its own threads.
ADMIN_WORKERS = env_int("LLMGW_ADMIN_WORKERS", 1, minimum=1)
# Observability (docs/observability.md): who may scrape /metrics, what the gateway counts and logs.
METRICS_TOKEN = env_str("LLMGW_METRICS_TOKEN", "")
METRICS_ALLOW = env_list("LLMGW_METRICS_ALLOW", "")
GATEWAY_METRICS = env_bool("LLMGW_GATEWAY_METRICS", True)
METRICS_KEY_LABELS = env_bool("LLMGW_METRICS_KEY_LABELS", False)
# `-` (stdout) or a file; unset, or false, off, no or 0, is off (not a file named "false").
GATEWAY_ACCESS_LOG = env_str("LLMGW_GATEWAY_ACCESS_LOG", "")
if GATEWAY_ACCESS_LOG.strip().lower() in {"false", "off", "no", "0"}:
    GATEWAY_ACCESS_LOG = ""
AGENT_METRICS_ADDR = env_str("LLMGW_AGENT_METRICS_ADDR", "")
AGENT_METRICS_TOKEN = env_str("LLMGW_AGENT_METRICS_TOKEN", "")

# --- applications -------------------------------------------------------------

INSTALLED_APPS = [
    "llmgw_site.apps.LlmgwAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    # Staff's API tokens, hashed and with an expiry (DRF's rest_framework.authtoken kept them in plain).
    "accounts",
    "drf_spectacular",
    # Swagger UI's files served from here, not from a CDN into the admin's origin.
    "drf_spectacular_sidecar",
    # Failed logins counted, and a username locked out from an address after LLMGW_LOGIN_FAILURES.
    "axes",
    "django_filters",
    "django_htmx",
    "mirror",
    "catalog",
    "fleet",
    "serving",
    "launcher",
    "gateway",
    # /me/ and the API of teams, keys and usage for everyone signed in (docs/teams.md).
    "people",
    # Who changed what (docs/audit.md): the tracked models are AUDITLOG_INCLUDE_TRACKING_MODELS below.
    # Before common, whose admin replaces the library's.
    "auditlog",
    # Its migration makes the staff groups (docs/roles.md).
    "common",
    # A page to talk to a model through the gateway (docs/playground.md).
    "playground",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Outside the session and auth middleware, which read the database (docs/failures.md).
    "common.database_away.DatabaseAwayMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # After authentication: who and from where, for the audit log (docs/audit.md).
    "common.audit.AuditMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into its answer.
    "axes.middleware.AxesMiddleware",
]
ROOT_URLCONF = "llmgw_site.urls"

if ROLE == "bytes":
    # Files and manifests only: no sessions, no CSRF, no auth. The byte listener
    # is what every node talks to, so nothing administrative may be reachable there.
    ROOT_URLCONF = "llmgw_site.urls_bytes"
    MIDDLEWARE = []

if ROLE == "gateway":
    # /v1/ is plain ASGI (gateway/app.py), never Django's handler: no middleware, no URLconf,
    # no sessions. The apps stay installed for the models the table is read through.
    ROOT_URLCONF = None
    MIDDLEWARE = []

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "llmgw_site.wsgi.application"

# --- database -----------------------------------------------------------------

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'llmgw.sqlite3'}"),
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, byte listener, the control worker) share one file:
    # wait for a lock rather than failing with "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # Tests run real worker processes against the test database, so it has to
    # be a file they can open, not an in-memory database of the test process.
    DATABASES["default"]["TEST"] = {"NAME": str(env_path("LLMGW_TEST_DB", VAR_DIR / "test.sqlite3", BASE_DIR))}
if ROLE == "bytes":
    # Every node's greenlets, and a stranger's, reach the byte listener: none may keep a connection to
    # the database past its request (under gevent each greenlet would keep its own, issue 33). The pass
    # check reads through a cache and closes its connection at once (fleet.enrolment.EnrolledNodes).
    DATABASES["default"]["CONN_MAX_AGE"] = 0
if ROLE == "gateway" and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A database that is away is noticed in seconds, not after the kernel's TCP timeout: the
    # gateway goes on serving from its last table meanwhile (docs/gateway.md).
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 3)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# The admin's own CSS and JS, served by the admin server itself: one process, no nginx needed.
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)

LOGIN_URL = "admin:login"

# --- staff: sign-in and what it carries -------------------------------------------

# The login throttle first (docs/roles.md): it refuses a locked-out username before a password is checked.
AUTHENTICATION_BACKENDS = [
    "common.login_throttle.LoginThrottle",
    "django.contrib.auth.backends.ModelBackend",
]
# Failed logins for one username from one address before both are locked out, and for how long.
LOGIN_FAILURES = env_int("LLMGW_LOGIN_FAILURES", 5, minimum=1)
LOGIN_LOCKOUT_S = env_int("LLMGW_LOGIN_LOCKOUT_S", 900, minimum=1)
AXES_FAILURE_LIMIT = LOGIN_FAILURES
AXES_COOLOFF_TIME = LOGIN_LOCKOUT_S / 3600  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "common.login_throttle.locked_out"
# Lifted with `manage.py axes_reset`; the admin lists no attempts (an app of its own, for superusers only anyway).
AXES_ENABLE_ADMIN = False
# Messages live in the session (the database), never in a cookie a browser or a proxy's log keeps.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# --- sign-in with the organisation's OpenID Connect provider (docs/sign-in.md) ----------

# No issuer, no provider: local accounts alone, as on a machine without one (the README's walk).
OIDC_ISSUER = env_str("LLMGW_OIDC_ISSUER", "").rstrip("/")
if OIDC_ISSUER and ROLE == "control":
    _issuer_host = oidc_issuer_host(OIDC_ISSUER)
    OIDC_RP_CLIENT_ID = env_str("LLMGW_OIDC_CLIENT_ID", "")
    OIDC_RP_CLIENT_SECRET = env_str("LLMGW_OIDC_CLIENT_SECRET", "")
    if not OIDC_RP_CLIENT_ID or not OIDC_RP_CLIENT_SECRET:
        raise SettingError(
            "LLMGW_OIDC_ISSUER is set, so LLMGW_OIDC_CLIENT_ID and LLMGW_OIDC_CLIENT_SECRET must be too: "
            "the client llmgw is registered as at the provider"
        )
    OIDC_PROVIDER_NAME = env_str("LLMGW_OIDC_PROVIDER_NAME", _issuer_host)
    OIDC_RP_SCOPES = env_str("LLMGW_OIDC_SCOPES", "openid email profile groups")
    if "openid" not in OIDC_RP_SCOPES.split():
        raise SettingError(f"LLMGW_OIDC_SCOPES must include openid, not {OIDC_RP_SCOPES!r}")
    OIDC_GROUPS_CLAIM = env_str("LLMGW_OIDC_GROUPS_CLAIM", "groups")
    OIDC_STAFF_GROUPS = frozenset(env_list("LLMGW_OIDC_STAFF_GROUPS", ""))
    OIDC_OPERATOR_GROUPS = frozenset(env_list("LLMGW_OIDC_OPERATOR_GROUPS", ""))
    OIDC_TEAM_PREFIX = os.environ.get("LLMGW_OIDC_TEAM_PREFIX", "llmgw-team-").strip()
    OIDC_TEAM_ADMIN_SUFFIX = os.environ.get("LLMGW_OIDC_TEAM_ADMIN_SUFFIX", "-admins").strip()
    OIDC_LANDING = env_str("LLMGW_OIDC_LANDING", "/me/")
    # A signed-in person's pages go back to the provider (silently) this often: one it disabled is out by then.
    OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS = env_int("LLMGW_OIDC_RENEW_S", 300, minimum=1)
    # Every ID token is RS256-signed by the provider's published keys (OpenID Connect requires RS256 of every provider).
    OIDC_RP_SIGN_ALGO = "RS256"
    OIDC_USE_PKCE = True
    # A provider that does not answer is an error in seconds, not a page hanging for ever.
    OIDC_TIMEOUT = env_int("LLMGW_OIDC_TIMEOUT_S", 10, minimum=1)
    AUTHENTICATION_BACKENDS.append("accounts.oidc.ProviderBackend")
    MIDDLEWARE.insert(
        MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1, "accounts.oidc.SessionRefresh"
    )

# --- API ----------------------------------------------------------------------

# How long a staff user's API token (`manage.py api_token`) works after it is made.
API_TOKEN_DAYS = env_int("LLMGW_API_TOKEN_DAYS", 30, minimum=1)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Closed unless a view says otherwise: staff, with the model's permission for the method (docs/roles.md).
    "DEFAULT_PERMISSION_CLASSES": ["common.permissions.ModelPermissions"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "common.api.Pagination",
    "DEFAULT_PARSER_CLASSES": [
        "common.api.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
}
# --- audit log (docs/audit.md) -------------------------------------------------

# How long an audit entry is kept; the beat's "audit-prune" deletes older ones daily.
AUDIT_DAYS = env_int("LLMGW_AUDIT_DAYS", 365, minimum=1)
# Values as JSON (a limit 100 -> 200 stays a number), each tracked model with the fields that
# say something: a heartbeat's figures or a pull's bytes would bury the changes people make.
# A secret is never written: its field is masked to "(secret)", or left out.
AUDITLOG_STORE_JSON_CHANGES = True
AUDITLOG_MASK_CALLABLE = "common.audit.mask_secret"
AUDITLOG_INCLUDE_TRACKING_MODELS = (
    {"model": "gateway.apikey", "exclude_fields": ["last_used"], "mask_fields": ["key_hash"]},
    "accounts.team",
    "accounts.teammember",
    {"model": "catalog.model", "exclude_fields": ["added_at"]},
    "catalog.profile",
    {
        "model": "fleet.node",
        "include_fields": ["name", "labels", "address", "draining", "token_hash"],
        "mask_fields": ["token_hash"],
    },
    # The autoscaler's count of a model's replicas (the catalog's scaling_min/max are the model's).
    {"model": "fleet.scale", "include_fields": ["model_name", "replicas", "why"]},
    {"model": "fleet.fetch", "include_fields": ["node", "source", "state", "requested_by", "error"]},
    {"model": "mirror.mirrorpull", "include_fields": ["url", "model", "version", "node", "requested_by", "state"]},
)

SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw API",
    "DESCRIPTION": "Mirror, catalog, fleet and serving of a private LLM fleet.",
    "VERSION": VERSION,  # the release, from pyproject.toml
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["common.permissions.ReadsLlmgw"],
    # Swagger UI and ReDoc from this server's static files (drf-spectacular-sidecar), never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Celery -------------------------------------------------------------------

# The broker and the log format, as every llmgw process has them; the control plane adds its routes and beat.
from contracts.process_settings import *  # noqa: E402, F403

if ROLE == "bytes":
    # The byte listener's own Redis user, where Redis has one per principal (docs/fleet.md,
    # "Redis users"): it reaches the tracker's keys and nothing else.
    REDIS_URL = CELERY_BROKER_URL = env_str("LLMGW_BYTES_REDIS_URL", REDIS_URL)  # noqa: F405

CELERY_TASK_ROUTES = {
    # A pull may take hours: on a queue and worker of its own (llmgw-pulls), never the control worker's slots.
    "mirror.pull": {"queue": "pulls"},
    "mirror.*": {"queue": "control"},
    "catalog.*": {"queue": "control"},
    "fleet.*": {"queue": "control"},
    "common.*": {"queue": "control"},
    # Reports from nodes go to the control plane; a fetch goes to the node
    # named when it is sent (queue="node.NAME"), never to a default queue.
    "agent.fetch_finished": {"queue": "control"},
}
# Fetch tasks set acks_late and reject_on_worker_lost themselves (they are safe
# to run twice): a worker that dies mid-download leaves the task to run again,
# and the part on disk makes the rerun resume rather than start over.
CELERY_BEAT_SCHEDULE = {
    "mirror-scan": {"task": "mirror.scan", "schedule": float(MIRROR_SCAN_INTERVAL_S)},
    # Also sent after every catalog change; the beat is what notices a node going quiet.
    "fleet-reconcile": {"task": "fleet.reconcile", "schedule": float(RECONCILE_INTERVAL_S)},
    "audit-prune": {"task": "common.prune_audit", "schedule": 86400.0},
}
# One scheduler in the whole fleet, whichever control host runs it (docs/fleet.md, "A second
# control host"): celery-redbeat keeps the schedule in Redis and holds a lease there (a Redis lock
# with an expiry, renewed on every tick). Every host runs `celery beat`; the one without the lease
# waits, trying every fifth of LLMGW_BEAT_LEASE_S, and takes the lease once the silent holder's lapses.
BEAT_LEASE_S = env_int("LLMGW_BEAT_LEASE_S", 60, minimum=2)
CELERY_BEAT_SCHEDULER = "redbeat.RedBeatScheduler"
CELERY_REDBEAT_REDIS_URL = REDIS_URL  # noqa: F405
CELERY_REDBEAT_REDIS_OPTIONS = {}  # the broker's transport options are the queues', not the lease's
CELERY_REDBEAT_KEY_PREFIX = "llmgw:beat:"
CELERY_REDBEAT_LOCK_KEY = "llmgw:beat:lease"
CELERY_REDBEAT_LOCK_TIMEOUT = BEAT_LEASE_S
# The holder renews the lease at least five times within it; the host that waits tries as often.
CELERY_BEAT_MAX_LOOP_INTERVAL = max(1, BEAT_LEASE_S // 5)

LOGGING = {**LOGGING, "loggers": {"django.db.backends": {"level": "WARNING"}}}  # noqa: F405
# django-axes says its version at every start and every login; failures and lockouts it still says (WARNING).
LOGGING["loggers"]["axes"] = {"level": "WARNING"}  # noqa: F405

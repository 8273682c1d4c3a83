"""What the byte listener counts. Its gunicorn workers share PROMETHEUS_MULTIPROC_DIR with the
admin server on a control-plane host, so the admin port's /metrics adds them up."""

from prometheus_client import Counter

BYTES_SERVED = Counter(
    "llmgw_bytes_served", "Bytes of mirror files the byte listener answered with (whole files and ranges)."
)
FILES_SERVED = Counter("llmgw_files_served", "GET requests for mirror files the byte listener answered.", ["status"])

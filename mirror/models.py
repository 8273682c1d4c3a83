"""The mirror's index: a copy of what the directory holds, refreshed by a scan.

Never a second record that can disagree for long: `mirror.scan.scan_mirror`
makes these rows match the disk, and anything that must be exact at the moment
(the byte listener's manifest) reads the disk instead.
"""

from django.db import models
from django.db.models import Count, Q, Sum


class MirrorVersionQuerySet(models.QuerySet):
    def with_totals(self):
        return self.annotate(
            file_count=Count("files"),
            total_bytes=Sum("files__bytes"),
            unhashed_count=Count("files", filter=Q(files__sha256="")),
        )


class MirrorVersion(models.Model):
    class State(models.TextChoices):
        EMPTY = "empty", "empty"
        HASHING = "hashing", "hashing"
        COMPLETE = "complete", "complete"

    model = models.CharField(max_length=255)
    version = models.CharField(max_length=255)
    first_seen = models.DateTimeField(auto_now_add=True)
    # Written only when a scan finds the version new or changed: a scan of an
    # unchanged mirror writes nothing, however many versions it holds.
    scanned_at = models.DateTimeField(help_text="When a scan last found it new or changed on disk.")
    # What the weights say about themselves (mirror.headers): read when a scan finds the
    # version new or changed, so the memory a model needs comes from its shape, not its size.
    headers = models.JSONField(default=dict, blank=True, help_text="What the weights' headers say (mirror.headers).")
    headers_read = models.DateTimeField(null=True, blank=True, help_text="When the headers were last read.")

    # The version as a BitTorrent v2 torrent (issue 24), computed from the directory when its
    # files are hashed, for exactly the files, sizes and sha256s `torrent_of` fingerprints:
    # kept here, in the index, never in a file beside the weights.
    torrent = models.BinaryField(blank=True, default=b"", editable=False)
    torrent_info_hash = models.CharField(max_length=64, blank=True, default="", help_text="BitTorrent v2 info-hash.")
    torrent_of = models.CharField(max_length=64, blank=True, default="", editable=False)

    objects = MirrorVersionQuerySet.as_manager()

    class Meta:
        ordering = ["model", "version"]
        constraints = [models.UniqueConstraint(fields=["model", "version"], name="mirror_version_unique")]
        # The mirror's rows are the directory's, never staff's to write; these are what staff do to it (docs/roles.md).
        permissions = [
            ("scan_mirror", "Can scan the mirror now"),
            ("pull_version", "Can pull a version from another mirror"),
        ]

    def __str__(self) -> str:
        return f"{self.model}/{self.version}"

    @property
    def address(self) -> str:
        """The version's address on the byte listener, which is where nodes fetch it."""
        from django.conf import settings

        return f"{settings.BYTES_URL}{self.model}/{self.version}/"

    def counts(self) -> tuple[int, int]:
        """(files, files not yet hashed): from `with_totals` when the row came from it, else counted."""
        if hasattr(self, "file_count"):
            return self.file_count, self.unhashed_count
        return self.files.count(), self.files.filter(sha256="").count()

    @property
    def state(self) -> str:
        files, unhashed = self.counts()
        if not files:
            return self.State.EMPTY
        return self.State.HASHING if unhashed else self.State.COMPLETE

    @property
    def state_description(self) -> str:
        """The state as staff read it: how far hashing is, while it is under way."""
        files, unhashed = self.counts()
        if self.state == self.State.HASHING:
            return f"{self.State.HASHING} ({files - unhashed} of {files} hashed)"
        return self.state


class MirrorFile(models.Model):
    version = models.ForeignKey(MirrorVersion, related_name="files", on_delete=models.CASCADE)
    name = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    mtime_ns = models.BigIntegerField(help_text="Modification time on disk, in nanoseconds.")
    # Valid for exactly the (bytes, mtime_ns) above: a scan that finds either
    # changed clears it, so a stale hash is never offered for new content.
    sha256 = models.CharField(max_length=64, blank=True, default="")
    hashed_at = models.DateTimeField(null=True, blank=True)
    # Claimed by the worker hashing it, so a scan every few seconds does not
    # start a second read of a 100 GB file that is already being hashed.
    hashing_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["version", "name"], name="mirror_file_unique")]

    def __str__(self) -> str:
        return f"{self.version}/{self.name}"


class MirrorPull(models.Model):
    """One copy of a version from another llmgw mirror into this one (`mirror.pull`, issue 24).

    The row is what the pull page and the versions' list show while it runs: the files
    themselves are staged under the mirror root's hidden `.pull/` and appear as a version
    only when whole and verified. `pass_key` is the other site's credential for this pull
    (the sha256 of the enrolment token that site issued us, which is what a pass is made
    from); it is held only while the pull runs and cleared when it ends.
    """

    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        DONE = "done", "done"
        FAILED = "failed", "failed"

    url = models.CharField(max_length=1000, help_text="The version's address on the other mirror's byte listener.")
    model = models.CharField(max_length=255)
    version = models.CharField(max_length=255)
    node = models.CharField(max_length=100, blank=True, default="", help_text="This site's node name at the other.")
    pass_key = models.CharField(max_length=64, blank=True, default="", editable=False)
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    bytes_total = models.BigIntegerField(default=0)
    bytes_done = models.BigIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    requested_by = models.CharField(max_length=150, blank=True, default="")
    started = models.DateTimeField(auto_now_add=True)
    # Written with every progress report: a running pull that stops writing it was interrupted.
    updated = models.DateTimeField(auto_now=True)
    finished = models.DateTimeField(null=True, blank=True)

    # A running pull reports about twice a second; this long without word, it is not running.
    SILENT_S = 30

    class Meta:
        ordering = ["-started"]

    def __str__(self) -> str:
        return f"pull of {self.model}/{self.version} from {self.url}"

    @property
    def interrupted(self) -> bool:
        from django.utils import timezone

        if self.state != self.State.RUNNING:
            return False
        return (timezone.now() - self.updated).total_seconds() > self.SILENT_S

    @property
    def percent(self) -> int:
        return int(100 * self.bytes_done / self.bytes_total) if self.bytes_total else 0

    @property
    def description(self) -> str:
        """The pull as staff read it, in one sentence."""
        if self.interrupted:
            return (
                f"interrupted: no word from it since {self.updated:%Y-%m-%d %H:%M:%S} UTC; nothing of it is in "
                "the mirror, and pulling the same address again goes on from the pieces already verified"
            )
        if self.state == self.State.RUNNING and self.bytes_total:
            return f"running: {self.bytes_done:,} of {self.bytes_total:,} bytes verified ({self.percent}%)"
        if self.state == self.State.FAILED:
            return f"failed: {self.error}"
        if self.state == self.State.DONE:
            return (
                f"done: {self.model}/{self.version} is in the mirror, {self.bytes_total:,} bytes, every file verified"
            )
        if self.state == self.State.RUNNING:
            return "running: reading the other mirror's manifest"
        return "queued: waiting for the control worker (mirror.pull on the control queue)"

from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.defaultfilters import filesizeformat
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from common.admin import RecordAdmin
from common.permissions import forbidden_unless

from . import scan, views
from .models import MirrorFile, MirrorVersion


def run_scan(request: HttpRequest, modeladmin: admin.ModelAdmin) -> None:
    report = scan.scan_mirror()
    from .tasks import hash_task

    for file_id in report.to_hash:
        hash_task.delay(file_id)
    modeladmin.message_user(request, f"Scanned {scan.disk.root()}: {report.summary()}.", messages.SUCCESS)
    for sentence in report.skipped:
        modeladmin.message_user(request, sentence, messages.WARNING)


class MirrorFileInline(admin.TabularInline):
    model = MirrorFile
    fields = ["name", "size", "sha256", "hashed_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="size")
    def size(self, obj: MirrorFile) -> str:
        return f"{filesizeformat(obj.bytes)} ({obj.bytes:,} bytes)"


# The header's facts as staff read them, in this order.
HEADER_ROWS = [
    ("format", "format"),
    ("architecture", "architecture"),
    ("layers", "layers"),
    ("heads", "attention heads"),
    ("kv_heads", "KV heads"),
    ("head_dim", "head size"),
    ("embedding", "embedding size"),
    ("trained_context", "trained context"),
    ("tensors", "tensors"),
]


def header_table(headers: dict, read_at) -> str:
    """The version's headers (mirror.headers) as a small table; why not, when they could not be read."""
    if read_at is None:
        return "not read yet: the next scan reads them"
    headers = headers or {}
    rows = [(label, headers[key]) for key, label in HEADER_ROWS if headers.get(key) not in (None, "")]
    types = headers.get("tensor_types") or {}
    if types:
        rows.append(("tensor types", ", ".join(f"{name} {filesizeformat(size)}" for name, size in types.items())))
    if headers.get("weights_bytes"):
        rows.append(("weights", f"{filesizeformat(headers['weights_bytes'])} ({headers['weights_bytes']:,} bytes)"))
    body = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", rows)
    table = format_html('<table id="weights-header">{}</table>', body) if rows else ""
    if headers.get("error"):
        return format_html(
            '{}<p class="errornote" id="header-error">The header could not be read: {}</p>', table, headers["error"]
        )
    if not rows or not headers.get("format"):
        return format_html("{}<p>No GGUF or safetensors file here: nothing to read.</p>", table)
    return table


@admin.register(MirrorVersion)
class MirrorVersionAdmin(RecordAdmin):
    list_display = ["model", "version", "file_count", "total_size", "state", "scanned_at"]
    list_filter = ["model"]
    search_fields = ["model", "version"]
    readonly_fields = ["model", "version", "address", "state", "weights_header", "first_seen", "scanned_at"]
    fields = readonly_fields
    inlines = [MirrorFileInline]
    actions = ["scan_action"]
    change_list_template = "admin/mirror/mirrorversion/change_list.html"
    change_form_template = "admin/mirror/mirrorversion/change_form.html"

    def get_queryset(self, request):
        return super().get_queryset(request).with_totals()

    # A RecordAdmin: the directory is the truth, rows appear and disappear with a scan,
    # and deleting a row would not delete the files (the next scan would bring it back).

    @admin.display(description="files", ordering="file_count")
    def file_count(self, obj) -> int:
        return obj.file_count

    @admin.display(description="total size", ordering="total_bytes")
    def total_size(self, obj) -> str:
        return filesizeformat(obj.total_bytes or 0)

    @admin.display(description="state")
    def state(self, obj) -> str:
        return obj.state_description

    @admin.display(description="address on the byte listener")
    def address(self, obj) -> str:
        return obj.address

    @admin.display(description="what the weights say")
    def weights_header(self, obj) -> str:
        return header_table(obj.headers, obj.headers_read)

    def has_scan_permission(self, request) -> bool:
        return request.user.has_perm("mirror.scan_mirror")

    @admin.action(description="Scan the mirror now", permissions=["scan"])
    def scan_action(self, request, queryset):
        run_scan(request, self)

    def get_urls(self):
        return [
            path("scan/", self.admin_site.admin_view(self.scan_view), name="mirror_mirrorversion_scan"),
            path("pull/", self.admin_site.admin_view(views.pull_page), name="mirror_pull"),
            path("pull/<int:pk>/", self.admin_site.admin_view(views.pull_detail), name="mirror_pull_detail"),
            path("pulls/", self.admin_site.admin_view(views.pull_list), name="mirror_pulls"),
        ] + super().get_urls()

    def scan_view(self, request: HttpRequest):
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if refusal := forbidden_unless(request, "mirror.scan_mirror"):
            return refusal
        run_scan(request, self)
        return HttpResponseRedirect(reverse("admin:mirror_mirrorversion_changelist"))

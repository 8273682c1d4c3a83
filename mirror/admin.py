from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.template.defaultfilters import filesizeformat
from django.urls import path, reverse

from common.admin import RecordAdmin

from . import scan
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


@admin.register(MirrorVersion)
class MirrorVersionAdmin(RecordAdmin):
    list_display = ["model", "version", "file_count", "total_size", "state", "scanned_at"]
    list_filter = ["model"]
    search_fields = ["model", "version"]
    readonly_fields = ["model", "version", "address", "state", "first_seen", "scanned_at"]
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

    @admin.action(description="Scan the mirror now")
    def scan_action(self, request, queryset):
        run_scan(request, self)

    def get_urls(self):
        return [
            path("scan/", self.admin_site.admin_view(self.scan_view), name="mirror_mirrorversion_scan"),
        ] + super().get_urls()

    def scan_view(self, request: HttpRequest):
        if request.method == "POST":
            run_scan(request, self)
        return HttpResponseRedirect(reverse("admin:mirror_mirrorversion_changelist"))

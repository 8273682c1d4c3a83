from django import forms
from django.contrib import admin
from django.http import HttpRequest, HttpResponseRedirect
from django.template.defaultfilters import filesizeformat
from django.urls import reverse

from catalog.rules import labels_problem
from common import one_time
from contracts.names import node_name_problem

from . import enrolment
from . import memory as measured_memory
from .models import Node


class NodeForm(forms.ModelForm):
    class Meta:
        model = Node
        fields = ["name", "address", "draining", "labels"]

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if problem := node_name_problem(name):
            raise forms.ValidationError(problem)
        return name

    def clean_address(self) -> str:
        address = self.cleaned_data["address"].strip()
        if problem := enrolment.address_problem(address):
            raise forms.ValidationError(problem)
        return address

    def clean_labels(self) -> dict:
        labels = self.cleaned_data["labels"]
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise forms.ValidationError('labels are written {"key": "value"}, each value text')
        if problem := labels_problem(labels):
            raise forms.ValidationError(problem)
        return labels


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    form = NodeForm
    list_display = [
        "name",
        "state",
        "engine_list",
        "unusable_engines",
        "gpu_count",
        "memory_gb",
        "memory_available",
        "disk_free",
        "agent_version",
        "last_heartbeat",
    ]
    list_filter = ["draining"]
    search_fields = ["name"]
    # What the agent reports is read-only: the next heartbeat would overwrite an edit.
    readonly_fields = [
        "state",
        "engines",
        "unusable_engines",
        "gpus",
        "memory_gb",
        "memory_available",
        "disk_free",
        "agent_version",
        "last_heartbeat",
        "enrolled",
        "created",
    ]
    actions = ["make_token"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "address", "labels"]
        return ["name", "address", "draining", "labels", *self.readonly_fields]

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields if obj is None else ["name", *self.readonly_fields]

    @admin.display(description="state")
    def state(self, obj: Node) -> str:
        return Node.State(obj.state).label

    @admin.display(description="engines")
    def engine_list(self, obj: Node) -> str:
        return ", ".join(obj.engines) or "—"

    @admin.display(description="installed but unusable")
    def unusable_engines(self, obj: Node) -> str:
        # The agent's self-test failed: why, in its own sentence, so staff know what to fix.
        return "; ".join(f"{engine}: {why}" for engine, why in sorted(obj.engines_unusable.items())) or "—"

    @admin.display(description="GPUs")
    def gpu_count(self, obj: Node) -> int:
        return obj.gpu_total

    @admin.display(description="available memory")
    def memory_available(self, obj: Node) -> str:
        # What the node's last heartbeat said the kernel can give (MemAvailable), kept in Redis.
        available = measured_memory.latest([obj.name])[1].get(obj.name)
        return "—" if available is None else filesizeformat(available)

    @admin.display(description="free disk", ordering="disk_free_bytes")
    def disk_free(self, obj: Node) -> str:
        return filesizeformat(obj.disk_free_bytes)

    @admin.display(description="enrolment token", boolean=True)
    def enrolled(self, obj: Node) -> bool:
        return bool(obj.token_hash)

    # A node added here has no way to speak until it has a token, so adding one makes its token too.
    def has_add_permission(self, request) -> bool:
        return super().has_add_permission(request) and self.has_issue_token_permission(request)

    def has_issue_token_permission(self, request) -> bool:
        return request.user.has_perm("fleet.issue_node_token")

    def save_model(self, request: HttpRequest, obj: Node, form, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if not change:
            self._keep_token(request, obj.name)

    def response_add(self, request, obj, post_url_continue=None):
        return HttpResponseRedirect(reverse("admin:one-time-secrets"))

    @admin.action(description="Make a new enrolment token (the old one stops working)", permissions=["issue_token"])
    def make_token(self, request: HttpRequest, queryset):
        for node in queryset:
            self._keep_token(request, node.name)
        return HttpResponseRedirect(reverse("admin:one-time-secrets"))

    def _keep_token(self, request: HttpRequest, name: str) -> None:
        # Shown once on its own page: only its hash is kept, so it cannot be shown again.
        one_time.keep(request, f"node {name} (LLMGW_NODE_TOKEN)", enrolment.issue_token(name))

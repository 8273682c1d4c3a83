"""API for replicas: `/api/fleet/replicas/`, read-only, staff only (the DRF default).

Replicas are written by the reconcile pass and the agents' reports, never by a
client: what a client changes is the catalog (scaling, profiles), and placement
follows.
"""

from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers, viewsets

from .. import engine_stats, memory
from ..models import MeasuredMemory, Replica, ReplicaShare, Scale


class MeasuredSerializer(serializers.Serializer):
    rss_bytes = serializers.IntegerField(source="rss", help_text="The engine's resident memory (RSS), in bytes.")
    pss_bytes = serializers.IntegerField(
        source="pss", allow_null=True, help_text="Its proportional share (PSS), where the node could read it."
    )
    gpu_bytes = serializers.IntegerField(source="gpu", help_text="GPU memory it holds, in bytes; 0 on the CPU.")
    host_bytes = serializers.IntegerField(source="host", help_text="PSS where known, else RSS: what placement books.")
    at = serializers.FloatField(help_text="When its node measured it, Unix time.")


class EstimateSerializer(serializers.Serializer):
    total_bytes = serializers.IntegerField(source="total", help_text="The whole estimate, in bytes.")
    weights_bytes = serializers.IntegerField(source="weights")
    kv_cache_bytes = serializers.IntegerField(source="kv_cache")
    pool_tokens = serializers.IntegerField(source="pool", help_text="The KV cache's pool, in tokens.")
    prompt_cache_bytes = serializers.IntegerField(source="prompt_cache")
    overhead_bytes = serializers.IntegerField(source="overhead")


class EngineLoadSerializer(serializers.Serializer):
    slots = serializers.IntegerField(help_text="The engine's parallel slots.")
    slots_busy = serializers.IntegerField(help_text="Slots decoding a request now.")
    requests_deferred = serializers.IntegerField(help_text="Requests waiting for a slot.")
    kv_cache_used = serializers.FloatField(help_text="How full its KV cache is, 0 to 1 (the page shows percent).")
    tokens_per_second = serializers.FloatField(help_text="Tokens generated per second over its last interval.")
    at = serializers.FloatField(help_text="When its node read it, Unix time.")


def live_figures(replicas: list[Replica]) -> dict:
    """What the replicas page shows beside a page of rows, read once for the page: measured, estimated, the engines'."""
    try:
        measured, _ = memory.latest({r.node.name for r in replicas if r.node_id})
    except Exception:
        measured = {}  # Redis away: no measurement to show, the rows still are
    return {
        "measured": measured,
        "headers": memory.headers_for(r.source for r in replicas),
        "stats": engine_stats.read() if replicas else {},
    }


class ShareSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    share = serializers.FloatField(help_text="Its part of the layers (llama.cpp's --tensor-split), 0 to 1.")
    memory_gb = serializers.IntegerField(help_text="What placement booked for it on its node, whole GB.")

    class Meta:
        model = ReplicaShare
        fields = ["node", "share", "memory_gb", "port", "state", "reason", "since"]
        read_only_fields = fields


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name", read_only=True)
    profile = serializers.CharField(source="profile_name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    memory_gb = serializers.IntegerField(read_only=True, help_text="What placement booked for it, whole GB.")
    memory_measured = serializers.SerializerMethodField(
        help_text="What its engine holds as its node last measured it (the page's 'measured'); null when not measured."
    )
    memory_estimate = serializers.SerializerMethodField(
        help_text="What the weights' headers say it will hold (the page's 'estimate'); null when they cannot say."
    )
    engine_load = serializers.SerializerMethodField(
        help_text="The engine's own live figures (the page's 'engine'); null when its node has not posted them lately."
    )
    shares = ShareSerializer(
        many=True,
        read_only=True,
        help_text="A replica across several nodes: its workers, each holding a share of the layers; `node` is its "
        "head. Empty for a replica on one node.",
    )

    class Meta:
        model = Replica
        fields = [
            "id",
            "model",
            "profile",
            "node",
            "state",
            "endpoint",
            "reason",
            "since",
            "attempts",
            "source",
            "engine",
            "args",
            "memory_gb",
            "memory_measured",
            "memory_estimate",
            "engine_load",
            "gpus",
            "cause",
            "shares",
        ]
        read_only_fields = fields

    def _figures(self, rows: list[Replica]) -> dict:
        # The list view reads them for its page; a single object reads its own.
        return self.context.get("figures") or live_figures(rows)

    @extend_schema_field(MeasuredSerializer(allow_null=True))
    def get_memory_measured(self, replica: Replica) -> dict | None:
        found = self._figures([replica])["measured"].get(replica.pk)
        # A node speaks only for its own replicas.
        if found is None or not replica.node_id or found.node != replica.node.name:
            return None
        return MeasuredSerializer(found).data

    @extend_schema_field(EstimateSerializer(allow_null=True))
    def get_memory_estimate(self, replica: Replica) -> dict | None:
        headers = self._figures([replica])["headers"].get(replica.source)
        found = memory.estimate_for(headers, replica.engine, replica.args or ())
        return None if found is None else EstimateSerializer(found).data

    @extend_schema_field(EngineLoadSerializer(allow_null=True))
    def get_engine_load(self, replica: Replica) -> dict | None:
        found = self._figures([replica])["stats"].get(replica.pk)
        return None if found is None else EngineLoadSerializer(found).data


class ReplicaFilter(filters.FilterSet):
    model = filters.CharFilter(field_name="model_name", help_text="a catalog model name")
    node = filters.CharFilter(field_name="node__name", help_text="a node's name")
    state = filters.ChoiceFilter(choices=Replica.State.choices)

    class Meta:
        model = Replica
        fields = ["model", "node", "state"]


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Where each model's replicas run, and for those that do not run, why not; what each holds and its engine's load.

    Filter with `?model=`, `?node=` and `?state=`. `memory_measured` and `engine_load` are live
    (what the nodes last posted), as on the replicas page.
    """

    serializer_class = ReplicaSerializer
    queryset = Replica.objects.select_related("node").prefetch_related("shares__node")
    filterset_class = ReplicaFilter

    def get_serializer(self, *args, **kwargs):
        if args:
            rows = list(args[0]) if isinstance(args[0], list | tuple) else [args[0]]
            # One Redis read and one query for the page, not one per row.
            kwargs["context"] = {**self.get_serializer_context(), "figures": live_figures(rows)}
            return self.get_serializer_class()(*args, **kwargs)
        return super().get_serializer(*args, **kwargs)


class ScaleSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name", read_only=True)

    class Meta:
        model = Scale
        fields = ["model", "replicas", "why", "changed", "last_request"]
        read_only_fields = fields


class ScaleViewSet(viewsets.ReadOnlyModelViewSet):
    """How many replicas the autoscaler wants of each model now, and why it last changed.

    The bounds (fewest, most, target load, quiet period, idle time) are the catalog's;
    `last_request` is the Unix time of the last request the gateway saw, or of the last wake.
    """

    serializer_class = ScaleSerializer
    queryset = Scale.objects.all()
    lookup_field = "model_name"
    lookup_url_kwarg = "model"
    lookup_value_regex = "[^/]+"


class MeasuredMemorySerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name", read_only=True)
    profile = serializers.CharField(source="profile_name", read_only=True)
    host_bytes = serializers.IntegerField(
        read_only=True,
        help_text="The most host memory a replica of it was measured to hold: PSS where known, else RSS.",
    )
    host_gb = serializers.IntegerField(
        read_only=True, help_text="The same in whole GB, rounded up: what placement books."
    )
    rss_bytes = serializers.IntegerField(read_only=True, help_text="Its RSS at that measurement.")
    gpu_bytes = serializers.IntegerField(read_only=True, help_text="GPU memory at that measurement.")
    replica = serializers.IntegerField(source="replica_id", read_only=True, help_text="The replica measured.")
    node = serializers.CharField(source="node_name", read_only=True, help_text="The node that measured it.")
    asked_gb = serializers.SerializerMethodField(
        help_text="The profile's min memory now (the page's 'asked'); null when the profile is gone."
    )
    bench = serializers.JSONField(
        read_only=True, help_text="`manage.py bench_replica`'s last result: per concurrency, tokens/s, TTFT, memory."
    )

    class Meta:
        model = MeasuredMemory
        fields = ["model", "profile", "source", "engine", "args", "host_bytes", "host_gb", "rss_bytes", "gpu_bytes"]
        fields += ["replica", "node", "measured_at", "asked_gb", "bench", "bench_at"]
        read_only_fields = fields

    def get_asked_gb(self, peak: MeasuredMemory) -> int | None:
        return memory.asked_gb(peak)


class MeasuredMemoryFilter(filters.FilterSet):
    model = filters.CharFilter(field_name="model_name", help_text="a catalog model name")
    profile = filters.CharFilter(field_name="profile_name", help_text="a profile's name")

    class Meta:
        model = MeasuredMemory
        fields = ["model", "profile"]


class MeasuredMemoryViewSet(viewsets.ReadOnlyModelViewSet):
    """The memory each model's profile was measured to use at most (what placement books once measured).

    Here rather than in the catalog's API: the catalog is a layer below the fleet that measures.
    Filter with `?model=` and `?profile=`.
    """

    serializer_class = MeasuredMemorySerializer
    queryset = MeasuredMemory.objects.all()
    filterset_class = MeasuredMemoryFilter

"""API for replicas: `/api/fleet/replicas/`, read-only, staff only (the DRF default).

Replicas are written by the reconcile pass and the agents' reports, never by a
client: what a client changes is the catalog (scaling, profiles), and placement
follows.
"""

from django_filters import rest_framework as filters
from rest_framework import serializers, viewsets

from ..models import Replica, Scale


class ReplicaSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model_name", read_only=True)
    profile = serializers.CharField(source="profile_name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

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
            "gpus",
            "cause",
        ]
        read_only_fields = fields


class ReplicaFilter(filters.FilterSet):
    model = filters.CharFilter(field_name="model_name", help_text="a catalog model name")
    node = filters.CharFilter(field_name="node__name", help_text="a node's name")
    state = filters.ChoiceFilter(choices=Replica.State.choices)

    class Meta:
        model = Replica
        fields = ["model", "node", "state"]


class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    """Where each model's replicas run, and for those that do not run, why not.

    Filter with `?model=`, `?node=` and `?state=`.
    """

    serializer_class = ReplicaSerializer
    queryset = Replica.objects.select_related("node")
    filterset_class = ReplicaFilter


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

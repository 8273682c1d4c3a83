from rest_framework import serializers

from contracts.progress import STATES

from ..models import Node


class NodeSerializer(serializers.ModelSerializer):
    state = serializers.CharField(read_only=True)
    gpu_total = serializers.IntegerField(read_only=True)
    enrolled = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "state",
            "draining",
            "labels",
            "engines",
            "gpus",
            "gpu_total",
            "memory_gb",
            "disk_free_bytes",
            "agent_version",
            "last_heartbeat",
            "enrolled",
            "created",
        ]
        # What the agent reports comes from heartbeats; staff set only draining.
        read_only_fields = [f for f in fields if f != "draining"]

    def validate(self, attrs):
        # Ignoring the rest silently would let a caller believe it had set a
        # node's memory, which the next heartbeat overwrites anyway.
        if others := sorted(set(self.initial_data) - {"draining"}):
            raise serializers.ValidationError(
                f"only draining can be set here; {', '.join(others)} {'comes' if len(others) == 1 else 'come'} "
                "from the node's heartbeats"
            )
        return attrs

    def get_enrolled(self, obj: Node) -> bool:
        return bool(obj.token_hash)


class NodeProgressSerializer(serializers.Serializer):
    node = serializers.CharField()
    state = serializers.ChoiceField(choices=list(STATES))
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField()
    files_done = serializers.IntegerField()
    files_total = serializers.IntegerField()
    current_file = serializers.CharField(allow_blank=True)
    rate = serializers.IntegerField(help_text="bytes a second")
    error = serializers.CharField(allow_blank=True)
    started = serializers.FloatField(help_text="Unix time")
    updated = serializers.FloatField(help_text="Unix time")


class ProgressSerializer(serializers.Serializer):
    source = serializers.CharField()
    nodes = NodeProgressSerializer(many=True)

from rest_framework import serializers

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

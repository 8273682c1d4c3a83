from rest_framework import serializers

from ..progress import STATES


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

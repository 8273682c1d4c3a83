from rest_framework import serializers

from ..models import MirrorFile, MirrorVersion


class MirrorFileSerializer(serializers.ModelSerializer):
    class Meta:
        model = MirrorFile
        fields = ["name", "bytes", "mtime_ns", "sha256", "hashed_at"]


class MirrorVersionSerializer(serializers.ModelSerializer):
    file_count = serializers.IntegerField(read_only=True)
    total_bytes = serializers.IntegerField(read_only=True)
    state = serializers.CharField(read_only=True)
    address = serializers.CharField(read_only=True)

    class Meta:
        model = MirrorVersion
        fields = ["id", "model", "version", "address", "file_count", "total_bytes", "state", "first_seen", "scanned_at"]


class MirrorVersionDetailSerializer(MirrorVersionSerializer):
    files = MirrorFileSerializer(many=True, read_only=True)
    # What the weights' headers say (mirror.headers): shape, tensor types and bytes, or `error`.
    headers = serializers.JSONField(read_only=True)

    class Meta(MirrorVersionSerializer.Meta):
        fields = MirrorVersionSerializer.Meta.fields + ["files", "headers", "headers_read"]

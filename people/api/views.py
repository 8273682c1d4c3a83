"""Teams, members, keys and usage for anyone signed in: each sees what people/access.py lets them see.

Staff with a model's view permission see every row; a person sees their teams, their teams'
members, their own keys and usage, and, as a team admin, the team's. A row someone may not
see answers 404, as a row that is not there does.
"""

from __future__ import annotations

import csv

from django.http import Http404, StreamingHttpResponse
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import generics, mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response

from accounts.models import Team, TeamMember
from gateway.models import ApiKey, Usage

from .. import access, services
from .serializers import (
    NewPersonalKeySerializer,
    PersonalKeySerializer,
    TeamBudgetsSerializer,
    TeamMemberSerializer,
    UsageRowSerializer,
)


def _of(view, model, rows):
    """The rows the requester may see; none when drf-spectacular asks without a requester, for the schema."""
    if getattr(view, "swagger_fake_view", False):
        return model.objects.none()
    return rows(view.request.user)


def _answer(call, *args):
    """A service's Problem as a 400 with its sentence, NotFound as a 404."""
    try:
        return call(*args)
    except services.NotFound as error:
        raise Http404(str(error)) from None
    except services.Problem as problem:
        raise serializers.ValidationError({"detail": str(problem)}) from None


class TeamViewSet(viewsets.ReadOnlyModelViewSet):
    """Your teams, with their budgets and what is left of each now (staff who may view teams: every team)."""

    serializer_class = TeamBudgetsSerializer
    permission_classes = [IsAuthenticated]

    def get_queryset(self):
        return _of(self, Team, access.teams).order_by("name")


class MemberFilter(filters.FilterSet):
    team = filters.NumberFilter(field_name="team_id", help_text="a team's id")

    class Meta:
        model = TeamMember
        fields = ["team"]


class MemberViewSet(mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    """The members of your teams. A team admin adds (POST: team, who, role) and removes them, except those the
    identity provider decides."""

    serializer_class = TeamMemberSerializer
    permission_classes = [IsAuthenticated]
    filterset_class = MemberFilter

    def get_queryset(self):
        return _of(self, TeamMember, access.members).order_by("team__name", "user__username")

    def create(self, request, *args, **kwargs):
        incoming = self.get_serializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        data = incoming.validated_data
        member = _answer(services.add_member, request.user, data["team_id"], data["who"], data.get("role", "member"))
        return Response(self.get_serializer(member).data, status=status.HTTP_201_CREATED)

    def destroy(self, request, *args, **kwargs):
        _answer(services.remove_member, request.user, kwargs["pk"])
        return Response(status=status.HTTP_204_NO_CONTENT)


class KeyFilter(filters.FilterSet):
    team = filters.NumberFilter(field_name="team_id", help_text="a team's id")
    person = filters.CharFilter(field_name="owner__username", help_text="the owner's username")
    active = filters.BooleanFilter()

    class Meta:
        model = ApiKey
        fields = ["team", "person", "active"]


class KeyViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Your own keys and, as a team admin, your team's (staff who may view keys: every key).

    POST makes a key of yours for one of your teams (name, team, optionally fewer models and an
    expiry) and answers its secret once. POST …/revoke/ turns a key off; its usage stays.
    """

    serializer_class = PersonalKeySerializer
    permission_classes = [IsAuthenticated]
    filterset_class = KeyFilter

    def get_queryset(self):
        return _of(self, ApiKey, access.keys).order_by("name")

    @extend_schema(responses={201: NewPersonalKeySerializer})
    def create(self, request, *args, **kwargs):
        incoming = PersonalKeySerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        data = incoming.validated_data
        key, secret = _answer(
            services.make_key, request.user, data["name"], data["team_id"], data.get("model_names"), data.get("expires")
        )
        answer = NewPersonalKeySerializer(key).data
        answer["key"] = secret
        return Response(answer, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: PersonalKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        return Response(PersonalKeySerializer(_answer(services.revoke_key, request.user, pk)).data)


class UsageFilter(filters.FilterSet):
    team = filters.NumberFilter(field_name="key__team_id", help_text="a team's id")
    key = filters.NumberFilter(field_name="key_id", help_text="a key's id")
    model = filters.CharFilter(field_name="model_name", help_text="a catalog model name")
    person = filters.CharFilter(field_name="key__owner__username", help_text="a key owner's username")
    since = filters.DateFilter(field_name="day", lookup_expr="gte", help_text="the first day, YYYY-MM-DD")
    until = filters.DateFilter(field_name="day", lookup_expr="lte", help_text="the last day, YYYY-MM-DD")

    class Meta:
        model = Usage
        fields = ["team", "key", "model", "person", "since", "until"]


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Requests, tokens and spend per key, model and day: your own keys' and, as a team admin, your team's."""

    serializer_class = UsageRowSerializer
    permission_classes = [IsAuthenticated]
    filterset_class = UsageFilter

    def get_queryset(self):
        return _of(self, Usage, access.usage).order_by("-day", "key__name", "model_name")


class UsageCSV(generics.ListAPIView):
    """The same usage as CSV, every row the filters keep (no pages): for a spreadsheet."""

    serializer_class = UsageRowSerializer
    permission_classes = [IsAuthenticated]
    filterset_class = UsageFilter
    pagination_class = None

    def get_queryset(self):
        return _of(self, Usage, access.usage).order_by("day", "key__name", "model_name")

    @extend_schema(responses={(200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="usage as CSV")})
    def get(self, request, *args, **kwargs):
        rows = self.filter_queryset(self.get_queryset())
        fields = UsageRowSerializer.Meta.fields

        class Echo:
            def write(self, value):
                return value

        writer = csv.writer(Echo())

        def lines():
            yield writer.writerow(fields)
            for row in rows.iterator(chunk_size=2000):
                data = UsageRowSerializer(row).data
                yield writer.writerow([_cell(data[f]) for f in fields])

        response = StreamingHttpResponse(lines(), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="usage.csv"'
        return response


def _cell(value) -> str:
    """A CSV cell a spreadsheet shows as text: a key's name like "=HYPERLINK(…)" is not run as a formula."""
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text

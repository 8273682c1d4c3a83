from django.urls import path
from rest_framework.routers import DefaultRouter

from .views import KeyViewSet, MemberViewSet, TeamViewSet, UsageCSV, UsageViewSet

router = DefaultRouter()
router.register("teams", TeamViewSet, basename="people-team")
router.register("members", MemberViewSet, basename="people-member")
router.register("keys", KeyViewSet, basename="people-key")
router.register("usage", UsageViewSet, basename="people-usage")
urlpatterns = [path("usage.csv", UsageCSV.as_view(), name="people-usage-csv"), *router.urls]

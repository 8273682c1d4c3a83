from django.urls import path
from rest_framework.routers import DefaultRouter

from .overview import FleetOverviewView
from .replicas import MeasuredMemoryViewSet, ReplicaViewSet, ScaleViewSet
from .views import NodeViewSet

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="fleet-node")
router.register("replicas", ReplicaViewSet, basename="fleet-replica")
router.register("scales", ScaleViewSet, basename="fleet-scale")
router.register("measured-memory", MeasuredMemoryViewSet, basename="fleet-measured-memory")
urlpatterns = [path("overview/", FleetOverviewView.as_view(), name="fleet-overview"), *router.urls]

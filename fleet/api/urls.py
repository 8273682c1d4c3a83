from rest_framework.routers import DefaultRouter

from .replicas import ReplicaViewSet, ScaleViewSet
from .views import NodeViewSet

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="fleet-node")
router.register("replicas", ReplicaViewSet, basename="fleet-replica")
router.register("scales", ScaleViewSet, basename="fleet-scale")
urlpatterns = router.urls

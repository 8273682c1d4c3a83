from rest_framework.routers import DefaultRouter

from .views import NodeViewSet

router = DefaultRouter()
router.register("nodes", NodeViewSet, basename="fleet-node")
urlpatterns = router.urls

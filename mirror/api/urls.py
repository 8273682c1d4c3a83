from rest_framework.routers import DefaultRouter

from .views import MirrorVersionViewSet

router = DefaultRouter()
router.register("versions", MirrorVersionViewSet, basename="mirror-version")
urlpatterns = router.urls

from rest_framework.routers import DefaultRouter

from .views import ApiKeyViewSet, UsageViewSet

router = DefaultRouter()
router.register("keys", ApiKeyViewSet, basename="gateway-key")
router.register("usage", UsageViewSet, basename="gateway-usage")
urlpatterns = router.urls

from django.urls import path
from rest_framework.routers import DefaultRouter

from .prompt_cache import PromptCacheView
from .views import ApiKeyViewSet, UsageViewSet

router = DefaultRouter()
router.register("keys", ApiKeyViewSet, basename="gateway-key")
router.register("usage", UsageViewSet, basename="gateway-usage")
urlpatterns = [path("prompt-cache/", PromptCacheView.as_view(), name="gateway-prompt-cache"), *router.urls]

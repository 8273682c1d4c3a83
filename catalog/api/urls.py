from rest_framework.routers import DefaultRouter

from .views import ModelViewSet

router = DefaultRouter()
router.register("models", ModelViewSet, basename="catalog-model")
urlpatterns = router.urls

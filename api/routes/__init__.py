"""Route modules; each builds an APIRouter over the daemon's service object."""

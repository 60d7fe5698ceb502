"""Running cosyserve on a cluster: the Ray Serve application (:mod:`cosyserve.deploy.ray`)."""

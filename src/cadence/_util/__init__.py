"""Small torch-free utilities (private): ``lazy`` (the lazy-name tables of the public
packages), ``owned`` (paths trusted only when the current user alone controls them),
``job_secret`` (the secret one job's ranks share). Nothing is imported here.
"""

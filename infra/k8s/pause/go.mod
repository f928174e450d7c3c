module kappa.local/pause

go 1.22

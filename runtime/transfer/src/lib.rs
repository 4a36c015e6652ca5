//! placeholder while the workspace bootstraps

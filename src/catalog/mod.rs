//! What the mesh knows about services and their pods: the model (`model.rs`), the store that
//! holds the catalog in use (`store.rs`), and its sources: the catalog file (`file.rs`) today,
//! the control plane (SPEC section 9) next. `vip.rs` gives services their virtual addresses. Every source produces the same validated model.
//! `metrics.rs` counts the file's reloads.

pub mod file;
pub mod metrics;
pub mod model;
pub mod store;
pub mod vip;

pub use model::{
    Breakers, Catalog, Endpoint, Labels, OnDemand, Outlier, PortProtocol, Route, RouteTarget,
    Service, Usage,
};
pub use store::CatalogStore;

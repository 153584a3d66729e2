//! The `hangar bench` figures: harnesses that start real processes and
//! print figures against targets.
//!
//! Nothing here is on the serving path: `hangar-runtime` is the live
//! control plane, and this crate measures it from the outside.
#![deny(missing_docs)]

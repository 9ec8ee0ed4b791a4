//! The search space: named knobs, their kinds and bounds, and the mapping
//! between a [`Point`] (knob values as the runtime understands them) and the
//! unit-cube encoding the Gaussian process works in.
//!
//! It must never know about any particular objective or runtime protocol: the
//! collective knobs live here only as a ready-made [`Space::collective`]
//! constructor and a typed [`CollectiveKnobs`] view of its points.
//!
//! Encoding: a continuous or integer knob is one coordinate in `[0, 1]`
//! (log-transformed first when the knob is log-scaled); a categorical knob
//! with `k` choices is `k` one-hot coordinates; a boolean is one `0/1`
//! coordinate. So the GP sees categories as categories (each with its own ARD
//! length scale), and the acquisition maximizer enumerates them instead of
//! rounding a float.

use std::fmt;

use thiserror::Error;

/// Default tensor-fusion threshold of the collective runtime (and Horovod): 64 MiB.
pub const DEFAULT_FUSION_THRESHOLD_BYTES: u64 = 64 * 1024 * 1024;
/// Default cycle time of our collective runtime, in milliseconds.
pub const DEFAULT_CYCLE_TIME_MS: f64 = 1.0;
/// Default of hierarchical allreduce in the collective runtime: off.
pub const DEFAULT_HIERARCHICAL_ALLREDUCE: bool = false;

/// Lowest fusion threshold the search space holds (1 KiB). The dimension is
/// log-scaled, and log scale cannot reach 0, so "fusion off" is represented
/// by the low end of the range: see [`FUSION_OFF_AT_OR_BELOW_BYTES`].
pub const FUSION_THRESHOLD_FLOOR_BYTES: f64 = 1024.0;
/// Highest fusion threshold the search space holds (512 MiB).
pub const FUSION_THRESHOLD_CEILING_BYTES: f64 = 512.0 * 1024.0 * 1024.0;
/// A suggested fusion threshold at or below this many bytes (4 KiB) is sent
/// to the runtime as `0` (fusion off). A threshold smaller than any gradient
/// tensor fuses nothing, so "off" and "tiny" are neighbours in behaviour too,
/// which is what lets the GP model them on one smooth log-scaled axis.
pub const FUSION_OFF_AT_OR_BELOW_BYTES: u64 = 4096;
/// Lowest cycle time in the collective space, in milliseconds.
pub const CYCLE_TIME_MIN_MS: f64 = 0.5;
/// Highest cycle time in the collective space, in milliseconds.
pub const CYCLE_TIME_MAX_MS: f64 = 50.0;

/// Name of the fusion-threshold knob in [`Space::collective`].
pub const FUSION_THRESHOLD_BYTES: &str = "fusion_threshold_bytes";
/// Name of the cycle-time knob in [`Space::collective`].
pub const CYCLE_TIME_MS: &str = "cycle_time_ms";
/// Name of the hierarchical-allreduce knob in [`Space::collective`].
pub const HIERARCHICAL_ALLREDUCE: &str = "hierarchical_allreduce";

/// Why a space or a point was refused.
#[derive(Debug, Error, PartialEq)]
pub enum SpaceError {
    /// A dimension was declared with bounds that hold no value.
    #[error("dimension `{name}`: bounds [{low}, {high}] are empty or not finite")]
    BadBounds {
        /// The dimension.
        name: String,
        /// Its lower bound.
        low: f64,
        /// Its upper bound.
        high: f64,
    },
    /// A log-scaled dimension must have a strictly positive lower bound.
    #[error("dimension `{name}`: log scale needs a lower bound > 0, got {low}")]
    LogScaleNonPositive {
        /// The dimension.
        name: String,
        /// Its lower bound.
        low: f64,
    },
    /// A categorical dimension needs at least two distinct choices.
    #[error("dimension `{name}`: a categorical knob needs at least 2 distinct choices")]
    TooFewChoices {
        /// The dimension.
        name: String,
    },
    /// Two dimensions share a name.
    #[error("dimension `{name}` is declared twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A space needs at least one dimension.
    #[error("a search space needs at least one dimension")]
    Empty,
    /// A point has a different number of values than the space has dimensions.
    #[error("point has {got} values but the space has {expected} dimensions")]
    WrongLength {
        /// Dimensions in the space.
        expected: usize,
        /// Values in the point.
        got: usize,
    },
    /// A value has the wrong kind for its dimension (e.g. a bool for a range).
    #[error("dimension `{name}`: expected a {expected} value, got {got}")]
    WrongKind {
        /// The dimension.
        name: String,
        /// The kind the dimension takes.
        expected: &'static str,
        /// The value given.
        got: Value,
    },
    /// A value lies outside its dimension's bounds, or is not finite.
    #[error("dimension `{name}`: value {got} is outside the space")]
    OutOfBounds {
        /// The dimension.
        name: String,
        /// The value given.
        got: Value,
    },
    /// A knob looked up by name is not in the space.
    #[error("no dimension named `{name}` in the space")]
    UnknownDimension {
        /// The name looked up.
        name: String,
    },
}

/// What values a dimension takes.
#[derive(Debug, Clone, PartialEq)]
pub enum DimKind {
    /// A real number in `[low, high]`, optionally searched on a log scale.
    Continuous {
        /// Lower bound (inclusive).
        low: f64,
        /// Upper bound (inclusive).
        high: f64,
        /// Search `ln(value)` uniformly instead of `value`.
        log_scale: bool,
    },
    /// An integer in `[low, high]`, optionally searched on a log scale.
    Integer {
        /// Lower bound (inclusive).
        low: i64,
        /// Upper bound (inclusive).
        high: i64,
        /// Search `ln(value)` uniformly instead of `value`.
        log_scale: bool,
    },
    /// One of a fixed set of named choices, one-hot encoded for the GP.
    Categorical {
        /// The choices, in the order [`Value::Choice`] indexes them.
        choices: Vec<String>,
    },
    /// On or off.
    Boolean,
}

/// One named knob of a search space.
#[derive(Debug, Clone, PartialEq)]
pub struct Dim {
    /// The knob's name, e.g. `cycle_time_ms`.
    pub name: String,
    /// What values it takes.
    pub kind: DimKind,
}

/// The value of one knob.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// A value of a [`DimKind::Continuous`] dimension.
    Real(f64),
    /// A value of a [`DimKind::Integer`] dimension.
    Integer(i64),
    /// The index of a choice of a [`DimKind::Categorical`] dimension.
    Choice(usize),
    /// A value of a [`DimKind::Boolean`] dimension.
    Bool(bool),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Real(v) => write!(f, "{v}"),
            Value::Integer(v) => write!(f, "{v}"),
            Value::Choice(i) => write!(f, "choice #{i}"),
            Value::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// A point of a search space: one value per dimension, in the space's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Point(pub Vec<Value>);

impl Point {
    /// The values, in the space's dimension order.
    pub fn values(&self) -> &[Value] {
        &self.0
    }
}

/// An ordered set of named dimensions.
#[derive(Debug, Clone, PartialEq)]
pub struct Space {
    dims: Vec<Dim>,
}

fn check_range(name: &str, low: f64, high: f64, log_scale: bool) -> Result<(), SpaceError> {
    if !(low.is_finite() && high.is_finite() && low < high) {
        return Err(SpaceError::BadBounds {
            name: name.to_owned(),
            low,
            high,
        });
    }
    if log_scale && low <= 0.0 {
        return Err(SpaceError::LogScaleNonPositive {
            name: name.to_owned(),
            low,
        });
    }
    Ok(())
}

/// Maps `v` in `[low, high]` to `[0, 1]`, on a log scale if asked.
fn to_unit(v: f64, low: f64, high: f64, log_scale: bool) -> f64 {
    let u = if log_scale {
        (v.ln() - low.ln()) / (high.ln() - low.ln())
    } else {
        (v - low) / (high - low)
    };
    u.clamp(0.0, 1.0)
}

/// Inverse of [`to_unit`]; clamps `u` into `[0, 1]` first.
fn from_unit(u: f64, low: f64, high: f64, log_scale: bool) -> f64 {
    let u = u.clamp(0.0, 1.0);
    let v = if log_scale {
        (low.ln() + u * (high.ln() - low.ln())).exp()
    } else {
        low + u * (high - low)
    };
    v.clamp(low, high)
}

impl Space {
    /// A space of the given dimensions, checked: non-empty, unique names,
    /// non-empty finite bounds, positive lower bounds on log scales, at
    /// least two distinct choices per categorical knob.
    pub fn new(dims: Vec<Dim>) -> Result<Self, SpaceError> {
        if dims.is_empty() {
            return Err(SpaceError::Empty);
        }
        for (i, dim) in dims.iter().enumerate() {
            if dims[..i].iter().any(|d| d.name == dim.name) {
                return Err(SpaceError::DuplicateName {
                    name: dim.name.clone(),
                });
            }
            match &dim.kind {
                DimKind::Continuous {
                    low,
                    high,
                    log_scale,
                } => check_range(&dim.name, *low, *high, *log_scale)?,
                DimKind::Integer {
                    low,
                    high,
                    log_scale,
                } => check_range(&dim.name, *low as f64, *high as f64, *log_scale)?,
                DimKind::Categorical { choices } => {
                    let distinct = choices
                        .iter()
                        .enumerate()
                        .all(|(j, c)| !choices[..j].contains(c));
                    if choices.len() < 2 || !distinct {
                        return Err(SpaceError::TooFewChoices {
                            name: dim.name.clone(),
                        });
                    }
                }
                DimKind::Boolean => {}
            }
        }
        Ok(Space { dims })
    }

    /// The collective runtime's knobs: `fusion_threshold_bytes` (continuous,
    /// log scale, 1 KiB to 512 MiB, where the bottom of the range means off:
    /// see [`FUSION_OFF_AT_OR_BELOW_BYTES`]), `cycle_time_ms` (continuous,
    /// log scale, 0.5 to 50 ms) and `hierarchical_allreduce` (boolean).
    pub fn collective() -> Self {
        Space::new(vec![
            Dim {
                name: FUSION_THRESHOLD_BYTES.to_owned(),
                kind: DimKind::Continuous {
                    low: FUSION_THRESHOLD_FLOOR_BYTES,
                    high: FUSION_THRESHOLD_CEILING_BYTES,
                    log_scale: true,
                },
            },
            Dim {
                name: CYCLE_TIME_MS.to_owned(),
                kind: DimKind::Continuous {
                    low: CYCLE_TIME_MIN_MS,
                    high: CYCLE_TIME_MAX_MS,
                    log_scale: true,
                },
            },
            Dim {
                name: HIERARCHICAL_ALLREDUCE.to_owned(),
                kind: DimKind::Boolean,
            },
        ])
        .expect("the collective space is declared with valid, distinct dimensions")
    }

    /// The dimensions, in order.
    pub fn dims(&self) -> &[Dim] {
        &self.dims
    }

    /// Index of the dimension called `name`.
    pub fn index_of(&self, name: &str) -> Result<usize, SpaceError> {
        self.dims
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| SpaceError::UnknownDimension {
                name: name.to_owned(),
            })
    }

    /// Number of coordinates of the unit-cube encoding (one-hot categories
    /// count once per choice).
    pub fn encoded_len(&self) -> usize {
        self.dims
            .iter()
            .map(|d| match &d.kind {
                DimKind::Categorical { choices } => choices.len(),
                _ => 1,
            })
            .sum()
    }

    /// Checks that `point` belongs to this space: right length, each value of
    /// its dimension's kind, finite and within bounds.
    pub fn validate(&self, point: &Point) -> Result<(), SpaceError> {
        if point.0.len() != self.dims.len() {
            return Err(SpaceError::WrongLength {
                expected: self.dims.len(),
                got: point.0.len(),
            });
        }
        for (dim, value) in self.dims.iter().zip(&point.0) {
            let in_bounds = match (&dim.kind, value) {
                (DimKind::Continuous { low, high, .. }, Value::Real(v)) => {
                    v.is_finite() && *low <= *v && *v <= *high
                }
                (DimKind::Integer { low, high, .. }, Value::Integer(v)) => {
                    *low <= *v && *v <= *high
                }
                (DimKind::Categorical { choices }, Value::Choice(i)) => *i < choices.len(),
                (DimKind::Boolean, Value::Bool(_)) => true,
                (kind, got) => {
                    let expected = match kind {
                        DimKind::Continuous { .. } => "real",
                        DimKind::Integer { .. } => "integer",
                        DimKind::Categorical { .. } => "choice",
                        DimKind::Boolean => "bool",
                    };
                    return Err(SpaceError::WrongKind {
                        name: dim.name.clone(),
                        expected,
                        got: *got,
                    });
                }
            };
            if !in_bounds {
                return Err(SpaceError::OutOfBounds {
                    name: dim.name.clone(),
                    got: *value,
                });
            }
        }
        Ok(())
    }

    /// The unit-cube encoding of a point (which must be valid: see
    /// [`Space::validate`]).
    pub fn encode(&self, point: &Point) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.encoded_len());
        for (dim, value) in self.dims.iter().zip(&point.0) {
            match (&dim.kind, value) {
                (
                    DimKind::Continuous {
                        low,
                        high,
                        log_scale,
                    },
                    Value::Real(v),
                ) => out.push(to_unit(*v, *low, *high, *log_scale)),
                (
                    DimKind::Integer {
                        low,
                        high,
                        log_scale,
                    },
                    Value::Integer(v),
                ) => out.push(to_unit(*v as f64, *low as f64, *high as f64, *log_scale)),
                (DimKind::Categorical { choices }, Value::Choice(i)) => {
                    out.extend((0..choices.len()).map(|j| if j == *i { 1.0 } else { 0.0 }));
                }
                (DimKind::Boolean, Value::Bool(b)) => out.push(if *b { 1.0 } else { 0.0 }),
                // A mismatched value encodes as the middle of its dimension so
                // that `encode` stays total; `validate` reports the mismatch.
                (DimKind::Categorical { choices }, _) => {
                    out.extend(std::iter::repeat_n(0.0, choices.len()));
                }
                _ => out.push(0.5),
            }
        }
        out
    }

    /// The point nearest to an encoded vector: coordinates are clamped to
    /// `[0, 1]`, integers rounded, each category is its largest one-hot
    /// coordinate, a boolean is on when its coordinate is ≥ 0.5.
    pub fn decode(&self, encoded: &[f64]) -> Point {
        let mut values = Vec::with_capacity(self.dims.len());
        let mut at = 0;
        for dim in &self.dims {
            let u = encoded.get(at).copied().unwrap_or(0.5);
            match &dim.kind {
                DimKind::Continuous {
                    low,
                    high,
                    log_scale,
                } => {
                    values.push(Value::Real(from_unit(u, *low, *high, *log_scale)));
                    at += 1;
                }
                DimKind::Integer {
                    low,
                    high,
                    log_scale,
                } => {
                    let v = from_unit(u, *low as f64, *high as f64, *log_scale).round() as i64;
                    values.push(Value::Integer(v.clamp(*low, *high)));
                    at += 1;
                }
                DimKind::Categorical { choices } => {
                    let mut best = 0;
                    for j in 1..choices.len() {
                        let here = encoded.get(at + j).copied().unwrap_or(0.0);
                        let best_so_far = encoded.get(at + best).copied().unwrap_or(0.0);
                        if here > best_so_far {
                            best = j;
                        }
                    }
                    values.push(Value::Choice(best));
                    at += choices.len();
                }
                DimKind::Boolean => {
                    values.push(Value::Bool(u >= 0.5));
                    at += 1;
                }
            }
        }
        Point(values)
    }

    /// Which encoded coordinates are free to vary continuously (continuous
    /// and integer knobs), as opposed to one-hot or boolean coordinates that
    /// the acquisition maximizer enumerates.
    pub(crate) fn continuous_coordinates(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut at = 0;
        for dim in &self.dims {
            match &dim.kind {
                DimKind::Continuous { .. } | DimKind::Integer { .. } => {
                    out.push(at);
                    at += 1;
                }
                DimKind::Categorical { choices } => at += choices.len(),
                DimKind::Boolean => at += 1,
            }
        }
        out
    }

    /// Every combination of the discrete knobs' values (categorical and
    /// boolean), as `(encoded coordinate, value)` assignments. A space with
    /// no discrete knob has one empty combination.
    pub(crate) fn discrete_combinations(&self) -> Vec<Vec<(usize, f64)>> {
        let mut combos: Vec<Vec<(usize, f64)>> = vec![Vec::new()];
        let mut at = 0;
        for dim in &self.dims {
            match &dim.kind {
                DimKind::Continuous { .. } | DimKind::Integer { .. } => at += 1,
                DimKind::Boolean => {
                    combos = combos
                        .into_iter()
                        .flat_map(|c| {
                            [0.0, 1.0].into_iter().map(move |v| {
                                let mut c = c.clone();
                                c.push((at, v));
                                c
                            })
                        })
                        .collect();
                    at += 1;
                }
                DimKind::Categorical { choices } => {
                    let k = choices.len();
                    let start = at;
                    combos = combos
                        .into_iter()
                        .flat_map(|c| {
                            (0..k).map(move |chosen| {
                                let mut c = c.clone();
                                c.extend(
                                    (0..k).map(|j| (start + j, f64::from(u8::from(j == chosen)))),
                                );
                                c
                            })
                        })
                        .collect();
                    at += k;
                }
            }
        }
        combos
    }

    /// The choice names of a categorical dimension, for display.
    pub fn describe(&self, index: usize, value: &Value) -> String {
        match (self.dims.get(index).map(|d| &d.kind), value) {
            (Some(DimKind::Categorical { choices }), Value::Choice(i)) => choices
                .get(*i)
                .cloned()
                .unwrap_or_else(|| format!("choice #{i}")),
            _ => value.to_string(),
        }
    }
}

/// The collective runtime's knobs as the runtime takes them, converted from
/// and to points of [`Space::collective`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveKnobs {
    /// Tensor-fusion threshold in bytes; `0` means fusion off.
    pub fusion_threshold_bytes: u64,
    /// Cycle time in milliseconds.
    pub cycle_time_ms: f64,
    /// Hierarchical allreduce on or off.
    pub hierarchical_allreduce: bool,
}

impl Default for CollectiveKnobs {
    /// The runtime's defaults.
    fn default() -> Self {
        CollectiveKnobs {
            fusion_threshold_bytes: DEFAULT_FUSION_THRESHOLD_BYTES,
            cycle_time_ms: DEFAULT_CYCLE_TIME_MS,
            hierarchical_allreduce: DEFAULT_HIERARCHICAL_ALLREDUCE,
        }
    }
}

impl CollectiveKnobs {
    /// The point of [`Space::collective`] for these knobs. Fusion off (`0`)
    /// maps to the floor of the threshold range; values are clamped into the
    /// space's bounds.
    pub fn to_point(&self) -> Point {
        let threshold = (self.fusion_threshold_bytes as f64)
            .clamp(FUSION_THRESHOLD_FLOOR_BYTES, FUSION_THRESHOLD_CEILING_BYTES);
        let cycle = if self.cycle_time_ms.is_finite() {
            self.cycle_time_ms
                .clamp(CYCLE_TIME_MIN_MS, CYCLE_TIME_MAX_MS)
        } else {
            DEFAULT_CYCLE_TIME_MS
        };
        Point(vec![
            Value::Real(threshold),
            Value::Real(cycle),
            Value::Bool(self.hierarchical_allreduce),
        ])
    }

    /// The knobs of a point of [`Space::collective`]: the threshold is rounded
    /// to whole bytes, and at or below [`FUSION_OFF_AT_OR_BELOW_BYTES`] it
    /// becomes `0` (off).
    pub fn from_point(point: &Point) -> Result<Self, SpaceError> {
        Space::collective().validate(point)?;
        let (threshold, cycle, hierarchical) = match point.0.as_slice() {
            [Value::Real(t), Value::Real(c), Value::Bool(h)] => (*t, *c, *h),
            _ => unreachable!("validated against the collective space above"),
        };
        let bytes = threshold.round() as u64;
        Ok(CollectiveKnobs {
            fusion_threshold_bytes: if bytes <= FUSION_OFF_AT_OR_BELOW_BYTES {
                0
            } else {
                bytes
            },
            cycle_time_ms: cycle,
            hierarchical_allreduce: hierarchical,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collective_defaults_round_trip_through_the_space() {
        let knobs = CollectiveKnobs::default();
        assert_eq!(knobs.fusion_threshold_bytes, 64 << 20);
        assert_eq!(knobs.cycle_time_ms, 1.0);
        assert!(!knobs.hierarchical_allreduce);
        let back = CollectiveKnobs::from_point(&knobs.to_point()).unwrap();
        assert_eq!(back, knobs);
    }

    #[test]
    fn fusion_off_is_the_floor_of_the_log_range() {
        let off = CollectiveKnobs {
            fusion_threshold_bytes: 0,
            ..CollectiveKnobs::default()
        };
        let point = off.to_point();
        let space = Space::collective();
        assert_eq!(space.encode(&point)[0], 0.0);
        assert_eq!(
            CollectiveKnobs::from_point(&point)
                .unwrap()
                .fusion_threshold_bytes,
            0
        );
        // 8 KiB is a real (small) threshold, not off.
        let small = CollectiveKnobs {
            fusion_threshold_bytes: 8192,
            ..off
        };
        assert_eq!(
            CollectiveKnobs::from_point(&small.to_point())
                .unwrap()
                .fusion_threshold_bytes,
            8192
        );
    }

    #[test]
    fn log_scale_encoding_puts_the_geometric_midpoint_at_one_half() {
        let space = Space::collective();
        // Geometric mean of 0.5 and 50 ms is 5 ms.
        let p = Point(vec![Value::Real(1e6), Value::Real(5.0), Value::Bool(true)]);
        let e = space.encode(&p);
        assert!((e[1] - 0.5).abs() < 1e-12);
        assert_eq!(e[2], 1.0);
        let back = space.decode(&e);
        match back.0[1] {
            Value::Real(v) => assert!((v - 5.0).abs() < 1e-9),
            other => panic!("expected a real, got {other:?}"),
        }
    }

    #[test]
    fn categorical_knobs_are_one_hot_and_enumerated() {
        let space = Space::new(vec![
            Dim {
                name: "algo".into(),
                kind: DimKind::Categorical {
                    choices: vec!["ring".into(), "tree".into(), "hier".into()],
                },
            },
            Dim {
                name: "chunks".into(),
                kind: DimKind::Integer {
                    low: 1,
                    high: 9,
                    log_scale: false,
                },
            },
            Dim {
                name: "pin".into(),
                kind: DimKind::Boolean,
            },
        ])
        .unwrap();
        assert_eq!(space.encoded_len(), 5);
        let p = Point(vec![
            Value::Choice(2),
            Value::Integer(5),
            Value::Bool(false),
        ]);
        assert_eq!(space.encode(&p), vec![0.0, 0.0, 1.0, 0.5, 0.0]);
        assert_eq!(space.decode(&space.encode(&p)), p);
        assert_eq!(space.continuous_coordinates(), vec![3]);
        let combos = space.discrete_combinations();
        assert_eq!(combos.len(), 6);
        assert!(combos.iter().all(|c| c.len() == 4));
        assert_eq!(space.describe(0, &Value::Choice(1)), "tree");
    }

    #[test]
    fn bad_spaces_and_points_are_refused() {
        let dim = |name: &str, low: f64, high: f64, log_scale| Dim {
            name: name.into(),
            kind: DimKind::Continuous {
                low,
                high,
                log_scale,
            },
        };
        assert!(matches!(Space::new(vec![]), Err(SpaceError::Empty)));
        assert!(matches!(
            Space::new(vec![dim("a", 1.0, 1.0, false)]),
            Err(SpaceError::BadBounds { .. })
        ));
        assert!(matches!(
            Space::new(vec![dim("a", 0.0, 1.0, true)]),
            Err(SpaceError::LogScaleNonPositive { .. })
        ));
        assert!(matches!(
            Space::new(vec![dim("a", 0.0, 1.0, false), dim("a", 0.0, 2.0, false)]),
            Err(SpaceError::DuplicateName { .. })
        ));
        let space = Space::collective();
        let short = Point(vec![Value::Real(1e6)]);
        assert!(matches!(
            space.validate(&short),
            Err(SpaceError::WrongLength { .. })
        ));
        let nan = Point(vec![
            Value::Real(f64::NAN),
            Value::Real(1.0),
            Value::Bool(false),
        ]);
        assert!(matches!(
            space.validate(&nan),
            Err(SpaceError::OutOfBounds { .. })
        ));
        let kind = Point(vec![
            Value::Real(1e6),
            Value::Bool(true),
            Value::Bool(false),
        ]);
        assert!(matches!(
            space.validate(&kind),
            Err(SpaceError::WrongKind { .. })
        ));
        let outside = Point(vec![
            Value::Real(1e12),
            Value::Real(1.0),
            Value::Bool(false),
        ]);
        assert!(matches!(
            space.validate(&outside),
            Err(SpaceError::OutOfBounds { .. })
        ));
    }
}
